// The contents buttons, wired up (pydata-sphinx-theme 0.17.1, issue #2451 upstream): the theme
// adds a hidden `.primary-toggle` to its navbar and both themes bind their drawers to the first
// `.primary-toggle` / `.secondary-toggle` in the page, so the visible buttons did nothing. Each
// visible one passes its click to the button the theme listens to.
document.addEventListener("DOMContentLoaded", () => {
  for (const kind of ["primary", "secondary"]) {
    const [bound, ...others] = document.querySelectorAll(`.${kind}-toggle`);
    for (const button of others) {
      button.addEventListener("click", (event) => {
        event.preventDefault();
        event.stopPropagation();
        bound.click();
      });
    }
  }
});

// Punctuation stays on the line of the formula it follows (review 2026-12-04, row 14): the
// theme makes each inline formula a box (`span.math`, inline-flex), and Chromium may break the
// line between that box and the "." after it, which then starts the next line. The formula and
// the punctuation right after it go into one span that does not wrap (pagedlab.css).
document.addEventListener("DOMContentLoaded", () => {
  for (const math of document.querySelectorAll("main span.math")) {
    const next = math.nextSibling;
    const mark = next && next.nodeType === Node.TEXT_NODE && next.data.match(/^[.,;:!?)\]]+/);
    if (!mark) continue;
    next.splitText(mark[0].length);  // `next` is now the punctuation alone
    const keep = document.createElement("span");
    keep.className = "pagedlab-nowrap";
    math.replaceWith(keep);
    keep.append(math, next);
  }
});

// Collapsed blocks (exercise answers, "Then and now" and other dropdowns, hidden outputs) print
// open, and close again after: paper cannot be clicked. sphinx-togglebutton does the same for
// its admonitions; tools/book_pdf.py sends `beforeprint` before it prints a page.
window.addEventListener("beforeprint", () => {
  for (const details of document.querySelectorAll("main details:not([open])")) {
    details.open = true;
    details.dataset.pagedlabPrintOpened = "";
  }
});
window.addEventListener("afterprint", () => {
  for (const details of document.querySelectorAll("main details[data-pagedlab-print-opened]")) {
    details.open = false;
    delete details.dataset.pagedlabPrintOpened;
  }
});
