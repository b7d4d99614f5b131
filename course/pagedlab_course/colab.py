"""Colab copies of the chapters: the MyST source turned into Markdown that Jupyter renders.

Colab and plain Jupyter know neither MyST roles nor directives, so a raw copy shows
``{glue:text}`` placeholders, ``{cite:p}`` keys and ``{prf:theorem}`` fences. Here every
markdown cell is rewritten as the book reads: glued values filled in (from the book build's
executed notebooks, remembered in the copy's metadata), citations as author-year links,
cross-references as links, proofs and admonitions as bold-titled text or blockquotes,
dropdowns as ``<details>``. Code cells are copied, the install cell first and shown; a cell
the book hides or folds is folded in Colab's form view (:func:`fold`).

    python -m pagedlab_course.colab book/ch*.md          # `make notebooks`
"""

from __future__ import annotations

import argparse
import codecs
import hashlib
import json
import ast
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import jupytext
import nbformat
import yaml

BUILD = Path("_build") / "jupyter_execute" / "book"  # a book build's executed notebooks


def repository() -> Path:
    """The book's repository: the folder the command runs in (``make notebooks``, the book's
    build and the tests all run at its root), passed in that way rather than found from where
    this package is installed."""
    root = Path.cwd()
    if not (root / "_config.yml").is_file():
        raise FileNotFoundError(f"{root} holds no _config.yml: run this at the book's root")
    return root

ROLE = re.compile(r"\{([a-z][\w:-]*)\}`([^`]*)`")
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|:{3,})(?P<rest>.*)$")
DIRECTIVE = re.compile(r"^\{(?P<name>[a-z][\w:-]*)\}\s*(?P<arg>.*)$")
TARGET = re.compile(r"^\((?P<label>[\w.:-]+)\)=\s*$")
EQ_LABEL = re.compile(r"^\$\$\s*\((?P<label>[\w.:-]+)\)\s*$")
TITLED = re.compile(r"^(?P<text>.*?)\s*<(?P<target>[^<>]+)>$", re.S)  # {ref}`text <label>`
LEFTOVER = re.compile(r"\{[a-z][\w:-]*\}`|^\s*(`{3,}|:{3,})\{|^\((?:[\w.:-]+)\)=\s*$|^:label:",
                      re.M)

ADMONITIONS = {"note", "tip", "hint", "important", "warning", "caution", "attention", "danger",
               "error", "seealso", "admonition", "margin", "sidebar", "topic", "epigraph"}
PROOF_KINDS = {"theorem", "lemma", "definition", "algorithm", "proposition", "corollary",
               "example", "remark", "conjecture", "axiom", "criterion", "exercise", "property",
               "observation", "assumption", "notation", "proof"}


def _config() -> dict:
    return yaml.safe_load((repository() / "_config.yml").read_text())


def colab_url(stem: str) -> str:
    """Where the launch button opens chapter ``stem``."""
    repo = _config()["repository"]
    path = repo["url"].removeprefix("https://github.com/")
    return f"https://colab.research.google.com/github/{path}/blob/{repo['branch']}/book/{stem}.ipynb"


def page_url(stem: str) -> str:
    """Where a page of the book with no notebook (notation, glossary) is published: the
    repository's GitHub Pages site."""
    owner, name = _config()["repository"]["url"].removeprefix("https://github.com/").split("/")
    return f"https://{owner}.github.io/{name}/book/{stem}.html"


def raw_url(path: str) -> str:
    """A file of the repository as Colab can load it (figures)."""
    repo = _config()["repository"]
    path_in_repo = repo["url"].removeprefix("https://github.com/")
    return f"https://raw.githubusercontent.com/{path_in_repo}/{repo['branch']}/{path}"


# --- citations -------------------------------------------------------------------------------

def _latex(text: str) -> str:
    import latexcodec  # noqa: F401  (registers the codec; a pybtex dependency)

    return codecs.decode(text, "ulatex").replace("{", "").replace("}", "").replace("~", " ")


@dataclass(frozen=True)
class Reference:
    authors: str  # "Kwon et al.", "Milakov and Gimelshein", "NVIDIA"
    year: str
    url: str | None

    def cite(self, textual: bool) -> str:
        text = f"{self.authors} ({self.year})" if textual else f"{self.authors}, {self.year}"
        return f"[{text}]({self.url})" if self.url else text


def author_year(entry) -> tuple[str, str]:
    """A pybtex entry's author-year pair: ("Kwon et al.", "2023"), ("Milakov and Gimelshein",
    ...), ("NVIDIA", ...); the book's bibliography style labels and sorts by the same."""
    people = entry.persons.get("author") or entry.persons.get("editor") or []
    last = [_latex(" ".join(p.prelast_names + p.last_names)) for p in people]
    if not last:
        names = _latex(entry.fields.get("organization", entry.fields.get("title", entry.key)))
    elif len(last) <= 2:
        names = " and ".join(last)
    else:
        names = f"{last[0]} et al."
    return names, entry.fields.get("year", "n.d.")


def sort_key(entry) -> tuple[str, str, str]:
    """Where an entry stands in the bibliography: by names (case and braces ignored), year,
    title."""
    names, year = author_year(entry)
    return names.casefold(), year, entry.fields.get("title", "").casefold()


def labelled(entries) -> list[tuple[str, str]]:
    """The (names, year) each of ``entries``, in bibliography order, is cited by: equal pairs
    get suffixes in that order (Smith, 2020a and Smith, 2020b), so a citation names one entry."""
    pairs = [author_year(e) for e in entries]
    count, seen = Counter(pairs), Counter()
    out = []
    for names, year in pairs:
        seen[names, year] += 1
        suffix = _letters(seen[names, year]) if count[names, year] > 1 else ""
        out.append((names, year + suffix))
    return out


def _letters(n: int) -> str:
    """The ``n``-th suffix, from 1: a, b, ..., z, aa, ab, ... (a prolific author's year runs
    past 26 entries)."""
    letters = ""
    while n:
        n, r = divmod(n - 1, 26)
        letters = chr(ord("a") + r) + letters
    return letters


def load_references(bib: Path | None = None) -> dict[str, Reference]:
    """The bibliography (the repository's ``book/references.bib`` unless ``bib`` is given)."""
    from pybtex.database import parse_file

    bib = bib or repository() / "book" / "references.bib"
    entries = sorted(parse_file(str(bib)).entries.values(), key=sort_key)
    refs = {}
    for entry, (names, year) in zip(entries, labelled(entries)):
        doi = entry.fields.get("doi")
        url = entry.fields.get("url") or (f"https://doi.org/{doi}" if doi else None)
        refs[entry.key] = Reference(names, year, url)
    return refs


# --- cross-reference targets across the book -------------------------------------------------

@dataclass
class Target:
    stem: str  # the chapter it lives in
    text: str  # what a reference to it reads as


@dataclass
class Book:
    """What a chapter's prose can point at: labels, equations, citations."""

    targets: dict[str, Target] = field(default_factory=dict)
    references: dict[str, Reference] = field(default_factory=dict)

    @classmethod
    def scan(cls, chapters) -> Book:
        book = cls(references=load_references())
        for path in chapters:
            lines = Path(path).read_text().splitlines()
            stem, equation = Path(path).stem, 0
            for i, line in enumerate(lines):
                nxt = lines[i + 1] if i + 1 < len(lines) else ""
                if m := TARGET.match(line):
                    book.targets[m["label"]] = Target(stem, nxt.lstrip("#").strip() or m["label"])
                elif m := EQ_LABEL.match(line.strip()):
                    equation += 1
                    book.targets[m["label"]] = Target(stem, f"({equation})")
                elif (m := FENCE.match(line)) and (d := DIRECTIVE.match(m["rest"])):
                    label = next((o.split(":", 2)[2].strip() for o in lines[i + 1:i + 6]
                                  if o.strip().startswith((":label:", ":name:"))), None)
                    if label:
                        kind = d["name"].split(":")[-1].capitalize()
                        text = f"{kind} ({d['arg']})" if d["arg"] and kind != "Figure" else kind
                        book.targets[label] = Target(stem, text)
        return book


# --- the conversion --------------------------------------------------------------------------

@dataclass
class Converter:
    """Rewrites one chapter's markdown; ``glue`` maps names to the text the book shows."""

    book: Book
    stem: str
    glue: dict[str, str]
    missing: set[str] = field(default_factory=set)

    def link(self, label: str, text: str | None = None) -> str:
        target = self.book.targets.get(label)
        if target is None:
            raise KeyError(f"{self.stem}: unknown reference target {label!r}")
        if target.stem == self.stem:
            url = f"#{label}"
        elif target.stem.startswith("ch"):
            url = colab_url(target.stem)
        else:
            url = page_url(target.stem)
        return f"[{text or target.text}]({url})"

    def role(self, match: re.Match) -> str:
        name, content = match.group(1), match.group(2)
        kind = name.split(":")[0]
        if kind == "glue":
            key, _, fmt = content.partition(":")
            if key not in self.glue:
                self.missing.add(key)
                return f"`{key}`"
            value = self.glue[key]
            return format(float(value), fmt) if fmt else value
        if kind == "cite":
            keys = [k.strip() for k in content.split(",")]
            missing = [k for k in keys if k not in self.book.references]
            if missing:
                raise KeyError(f"{self.stem}: citation keys not in references.bib: {missing}")
            textual = name in ("cite:t", "cite:ts")
            cites = "; ".join(self.book.references[k].cite(textual) for k in keys)
            return cites if textual else f"({cites})"
        titled = TITLED.match(content)
        text, target = (titled["text"], titled["target"]) if titled else (None, content)
        if name in ("ref", "numref", "prf:ref", "eq"):
            return self.link(target.strip(), text)
        if name == "doc":
            stem = Path(target).stem
            return f"[{text or stem}]({colab_url(stem)})"
        if name in ("code", "kbd", "file", "samp"):
            return f"`{content}`"
        if name == "math":
            return f"${content}$"
        if name == "abbr":
            return re.sub(r"\s*\(.*\)$", "", content)
        return text or content  # term, sub-ref, ... : the words the book shows

    def inline(self, text: str) -> str:
        return ROLE.sub(self.role, text)

    def markdown(self, text: str) -> str:
        """A markdown cell, directives and all."""
        lines, out, i = text.split("\n"), [], 0
        while i < len(lines):
            line = lines[i]
            fence = FENCE.match(line)
            if fence and (d := DIRECTIVE.match(fence["rest"])):
                close = fence["fence"]
                j = i + 1
                while j < len(lines) and lines[j].strip() != close:
                    j += 1
                body = [b[len(fence["indent"]):] for b in lines[i + 1:j]]
                # every line keeps the fence's indent (a hint inside a list item stays in it)
                out.extend(fence["indent"] + b for part in self.directive(d["name"], d["arg"], body)
                           for b in part.split("\n"))
                i = j + 1
            elif fence:  # a plain code fence: copied as it is
                j = i + 1
                while j < len(lines) and lines[j].strip() != fence["fence"]:
                    j += 1
                out.extend(lines[i:j + 1])
                i = j + 1
            elif m := TARGET.match(line):
                out.append(f'<a id="{m["label"]}"></a>')
                i += 1
            elif m := EQ_LABEL.match(line.strip()):
                # the closing $$ of a labelled equation: number it as the book does
                out[-1:] = [out[-1], rf"\tag{{{self.book.targets[m['label']].text[1:-1]}}}"]
                out.append(f'$$ <a id="{m["label"]}"></a>')
                i += 1
            else:
                out.append(self.inline(line))
                i += 1
        return "\n".join(out)

    def directive(self, name: str, arg: str, body: list[str]) -> list[str]:
        options = {}
        while body and (m := re.match(r"^:([\w-]+):\s*(.*)$", body[0])):
            options[m[1]] = m[2]
            body = body[1:]
        while body and not body[0].strip():
            body = body[1:]
        content = self.markdown("\n".join(body)).strip("\n")
        anchor = [f'<a id="{options.get("label") or options["name"]}"></a>'] if (
            "label" in options or "name" in options) else []
        kind = name.split(":")[-1]
        title = self.inline(arg.strip())
        if name.startswith("prf:") or kind in PROOF_KINDS:
            head = f"**{kind.capitalize()}{f' ({title})' if title else ''}.**"
            end = [" $\\square$"] if kind == "proof" else []
            return [*anchor, head, "", content + "".join(end)]
        if kind == "dropdown" or "dropdown" in options.get("class", ""):
            summary = title or kind.capitalize()
            return [*anchor, f"<details><summary>{summary}</summary>", "", content, "",
                    "</details>"]
        if kind in ADMONITIONS:
            heading = title if kind == "admonition" else (title or kind.capitalize())
            quoted = [f"> {c}" if c.strip() else ">" for c in content.split("\n")]
            return [*anchor, f"> **{heading}**", ">", *quoted]
        if kind in ("figure", "image"):
            src = raw_url(str((Path("book") / arg.strip()).as_posix()))
            width = f' width="{options["width"]}"' if "width" in options else ""
            caption = [f"*{c}*" if c.strip() else c for c in content.split("\n")] if content else []
            return [*anchor, f'<img src="{src}" alt="{options.get("alt", "")}"{width}>', "",
                    *caption]
        if kind == "glossary":
            return self.glossary(body)
        if kind == "math":
            tag = ([rf"\tag{{{self.book.targets[options['label']].text[1:-1]}}}"]
                   if "label" in options else [])
            return [*anchor, "$$", *body, *tag, "$$"]
        if kind in ("code-block", "code", "sourcecode"):
            return [f"```{arg.strip()}", *body, "```"]
        if kind == "literalinclude":
            source = (repository() / "book" / arg.strip()).resolve().read_text().rstrip("\n")
            return [f"```{options.get('language', 'python')}", source, "```"]
        if kind in ("toctree", "tableofcontents", "bibliography"):
            return []
        raise ValueError(f"{self.stem}: no Colab form for the {{{name}}} directive")

    def glossary(self, body: list[str]) -> list[str]:
        """Definition-list glossary: unindented terms, indented definitions."""
        out, term, text = [], None, []

        def flush():
            if term is not None:
                out.extend([f"**{term}**: " + self.inline(" ".join(t.strip() for t in text)), ""])

        for line in body:
            if line.strip() and not line.startswith((" ", "\t")):
                flush()
                term, text = line.strip(), []
            elif line.strip():
                text.append(line)
        flush()
        return out


def built_glue(stem: str, build: Path = BUILD) -> dict[str, str] | None:
    """The glued values (as the book shows them) of the last book build, if there is one:
    MyST-NB writes each chapter's glue beside its executed notebook."""
    path = build / f"{stem}.glue.json"
    if not path.exists():
        return None
    values = {}
    for name, output in json.loads(path.read_text()).items():
        text = output["data"]["text/plain"]
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        values[name] = value if isinstance(value, str) else text
    return values


def install_cell_first(cells: list) -> list:
    """The cell that installs pagedlab, moved to the top and shown (Colab runs top down)."""
    index = next(i for i, c in enumerate(cells) if c.cell_type == "code")
    install = cells[index]
    if "pip install" not in install.source:
        raise ValueError("the first code cell of a chapter must install pagedlab")
    install.metadata["tags"] = [t for t in install.metadata.get("tags", [])
                                if t not in ("remove-cell", "remove-input", "hide-input")]
    if not install.metadata["tags"]:
        del install.metadata["tags"]
    return [install, *cells[:index], *cells[index + 1:]]


# What Colab shows in place of a cell the book hides (remove-cell) or folds (hide-input). Colab
# ignores the book's tags but keeps a cell in its form view, ``cellView: "form"`` with a
# ``# @title`` first line: the title and the output show, the code only after "Show code".
# JupyterLab folds a cell whose ``jupyter.source_hidden`` is set.
FOLDED = {"remove-cell": "Bookkeeping the book hides: values its text quotes, and checks of them",
          "remove-input": "The code of this output (hidden in the book)",
          "hide-input": "The code of this output (folded in the book)"}


def fold(cell: nbformat.NotebookNode) -> None:
    """Put a code cell the book hides or folds in Colab's form view, titled by its first
    comment line if it starts with one."""
    tag = next((t for t in cell.metadata.get("tags", []) if t in FOLDED), None)
    if cell.cell_type != "code" or tag is None:
        return
    first = cell.source.split("\n", 1)[0]
    title = first.lstrip("# ").strip() if first.startswith("#") else FOLDED[tag]
    cell.source = f'# @title {title} {{ display-mode: "form" }}\n{cell.source}'
    cell.metadata["cellView"] = "form"
    cell.metadata["jupyter"] = {"source_hidden": True}


def convert(chapter: Path, book: Book, glue: dict[str, str]) -> tuple[nbformat.NotebookNode, set]:
    """The Colab copy of ``chapter`` and the glued names that had no value."""
    chapter = Path(chapter)
    nb = jupytext.read(chapter)
    nb.metadata.pop("jupytext", None)
    conv = Converter(book, chapter.stem, glue)
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = conv.markdown(cell.source)
    nb.cells = install_cell_first(nb.cells)
    seen = Counter()
    for cell in nb.cells:
        fold(cell)
        # an id from the cell's text, not a random one: regenerating changes only what changed
        digest = hashlib.sha1(f"{cell.cell_type}\n{cell.source}".encode()).hexdigest()[:8]
        seen[digest] += 1
        cell.id = digest if seen[digest] == 1 else f"{digest}-{seen[digest]}"
    used = set(re.findall(r"\{glue(?::\w+)?\}`([^`:]+)", chapter.read_text()))
    nb.metadata["pagedlab"] = {"source": f"book/{chapter.name}",
                               "glue": {k: glue[k] for k in sorted(used) if k in glue}}
    return nb, conv.missing


def stored_glue(colab: Path) -> dict[str, str]:
    """The values an existing Colab copy was made with."""
    if not colab.exists():
        return {}
    return dict(nbformat.read(colab, as_version=4).metadata.get("pagedlab", {}).get("glue", {}))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("chapters", nargs="+", type=Path)
    parser.add_argument("--build", type=Path, default=BUILD,
                        help="executed notebooks of a book build (default: _build/...)")
    args = parser.parse_args(argv)
    book = Book.scan(sorted((repository() / "book").glob("*.md")))  # chapters and back matter
    status = 0
    for chapter in args.chapters:
        colab = chapter.with_suffix(".ipynb")
        glue = {**stored_glue(colab), **(built_glue(chapter.stem, args.build) or {})}
        nb, missing = convert(chapter, book, glue)
        nbformat.write(nb, colab)
        if missing:
            status = 1
            print(f"{colab}: no value for {sorted(missing)}: build the book (`make book`) first",
                  file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
