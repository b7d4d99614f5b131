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
