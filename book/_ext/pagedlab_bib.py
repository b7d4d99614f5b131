"""The bibliography's pybtex style: author-year labels, as the text cites, sorted by author.

pybtex's own styles label entries alpha-style ([KLZ+23]) and sort braced names such as
``{NVIDIA}`` after Z; this one labels "Kwon et al., 2023" (the names the Colab copies cite
with, :func:`pagedlab.colab.author_year`) and sorts on those names, case and braces ignored.
"""

from collections import Counter

from pybtex.plugin import register_plugin
from pybtex.style.formatting.unsrt import Style as UnsrtStyle
from pybtex.style.labels import BaseLabelStyle
from pybtex.style.sorting import BaseSortingStyle

from pagedlab.colab import author_year


class AuthorYearLabels(BaseLabelStyle):
    def format_labels(self, sorted_entries):
        labels = [", ".join(author_year(e)) for e in sorted_entries]
        count, seen = Counter(labels), Counter()
        for label in labels:  # Smith, 2020a and Smith, 2020b
            seen[label] += 1
            yield label + (chr(ord("a") + seen[label] - 1) if count[label] > 1 else "")


class AuthorYearSorting(BaseSortingStyle):
    def sorting_key(self, entry):
        names, year = author_year(entry)
        return names.casefold(), year, entry.fields.get("title", "").casefold()


class AuthorYearStyle(UnsrtStyle):
    default_label_style = AuthorYearLabels
    default_sorting_style = AuthorYearSorting


def setup(app):
    register_plugin("pybtex.style.formatting", "pagedlab_author_year", AuthorYearStyle)
    return {"parallel_read_safe": True}
