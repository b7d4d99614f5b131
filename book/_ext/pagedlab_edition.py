"""Every page says which edition of the book it is: the CPU edition (chapters run on a CPU,
Triton's kernels in its interpreter, small problem sizes) or the GPU edition (compiled kernels,
large sizes), which `pages.yml` publishes whenever the GPU workflow has built it (issue 48).

The line is made once per build from :mod:`pagedlab.device`, the module that chose how the
chapters ran, and shown as the theme's announcement banner at the top of every page.
"""


def edition() -> str:
    """One sentence naming the edition and what its numbers were measured on."""
    from pagedlab import device

    if device.HAS_CUDA:
        import torch

        return (f"GPU edition: every chapter ran on a GPU ({torch.cuda.get_device_name(0)}), "
                f"Triton's kernels compiled, at the {device.size_preset()} size preset.")
    kernels = ("Triton's kernels in its interpreter" if device.has_triton()
               else "the torch reference kernels (no Triton)")
    return (f"CPU edition: every chapter ran on a CPU, {kernels}, at the "
            f"{device.size_preset()} size preset. Times and sizes are a laptop's, not a GPU's.")


def _config_inited(app, config) -> None:
    config.html_theme_options = {**(config.html_theme_options or {}), "announcement": edition()}


def setup(app):
    app.connect("config-inited", _config_inited)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
