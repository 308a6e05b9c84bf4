// The dashboard's only script, and the page works without it: it refreshes the overview's live
// part in place (paused while the tab is hidden), selects all rows, and asks before actions.
"use strict";
(function () {
  const live = document.getElementById("live");
  const every = live ? Number(live.dataset.every) : 0;
  if (live && every > 0) {
    setInterval(async function () {
      if (document.hidden) return;
      try {
        const response = await fetch(live.dataset.src, { credentials: "same-origin" });
        if (response.ok) live.innerHTML = await response.text();
      } catch (error) { /* offline for a moment: the next tick tries again */ }
    }, every * 1000);
  }
  document.addEventListener("change", function (event) {
    if (!event.target.matches("[data-select-all]")) return;
    const form = event.target.closest("form");
    form.querySelectorAll('input[name="ids"]').forEach(function (box) {
      box.checked = event.target.checked;
    });
  });
  document.addEventListener("click", function (event) {
    const button = event.target.closest("button[data-confirm]");
    if (button && !window.confirm(button.dataset.confirm)) event.preventDefault();
  });
})();
