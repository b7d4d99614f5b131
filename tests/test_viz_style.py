"""The figure style: a figure made under it reads at 9 pt or more on the book's page; the
wide, small-font figures the book used to have are caught."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from pagedlab.viz import style  # noqa: E402


def two_panels(**subplots):
    fig, axes = plt.subplots(1, 2, **subplots)
    for ax in axes:
        ax.plot([1, 2, 3], label="a curve")
        ax.set(xlabel="block size", ylabel="max |error|", title="online_softmax")
        ax.legend()
    fig.suptitle("a title")
    return fig


def test_a_figure_in_the_book_style_reads_at_9pt_or_more():
    with matplotlib.rc_context():
        style.use()
        fig = two_panels()
        assert fig.get_figwidth() * fig.dpi == style.PAGE_PX
        assert style.small_text(fig) == []
        plt.close(fig)


def test_an_eleven_inch_figure_with_8pt_legends_is_caught():
    with matplotlib.rc_context({"figure.dpi": 100, "font.size": 10, "legend.fontsize": 8}):
        fig = two_panels(figsize=(11, 4))
        small = style.small_text(fig)
        plt.close(fig)
    # shown at 700 of its 1,100 px: 8 pt legends read at 5.3 pt, 10 pt labels at 6.6 pt
    assert "'a curve': 5.3 pt" in small and "'block size': 6.6 pt" in small


def test_display_size_is_the_figure_scaled_to_the_page():
    fig = plt.figure(figsize=(14, 3), dpi=100)
    assert style.display_pt(fig, 12) == 12 * 700 / (14 * 96)
    small = plt.figure(figsize=(3.5, 3), dpi=100)  # 350 px: shown at its own size
    assert style.display_pt(small, 12) == 12 * 350 / (3.5 * 96)
    plt.close("all")


def test_overlapping_text_finds_labels_that_run_together():
    """Bar labels on adjacent narrow bars collide (chapter 1's "3030"); spread out, they do not."""
    with matplotlib.rc_context():
        style.use()
        for width, crowded in ((0.2, True), (3.0, False)):
            fig, ax = plt.subplots(figsize=(width + 1, 2))
            bars = ax.bar([0, 1, 2], [100, 100, 100], 0.9)
            ax.bar_label(bars)
            ax.set_xticks([0, 1, 2], ["Llama-2-7B", "Llama-2-13B", "OPT-13B"])
            found = style.overlapping_text(fig)
            assert bool(found) == crowded, (width, found)
            if crowded:
                assert any("'100' overlaps '100'" in f for f in found), found
            plt.close(fig)
    fig, ax = plt.subplots()
    ax.text(1.5, 0.5, "far outside", transform=ax.transAxes)
    assert style.overlapping_text(fig) == ["'far outside' leaves the figure"]
    plt.close(fig)
