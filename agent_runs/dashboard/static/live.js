// agent_runs dashboard: live refresh. Every few seconds, while the tab is visible, fetch this
// same URL and swap in the regions marked data-live (same id). Reading is never disturbed: a
// region is left as it is while it holds the focus or part of a selection, or while a box
// inside it is scrolled; a page the server marks final (a finished run) is never refreshed,
// and the Pause button stops refreshing for the rest of the browser session. Paused while the
// tab is hidden. Pages are complete without it. It also folds the runs filters on a phone.
(function () {
  "use strict";
  // On a narrow screen, the filters without a value set start folded (open without script).
  if (window.matchMedia && window.matchMedia("(max-width: 720px)").matches) {
    var folding = document.querySelectorAll("details[data-fold-narrow]");
    for (var f = 0; f < folding.length; f++) { folding[f].open = false; }
  }
})();

(function () {
  "use strict";
  var body = document.body;
  var seconds = Number(body.getAttribute("data-refresh"));
  if (!seconds || !window.fetch || !window.DOMParser) { return; }
  var state = document.getElementById("live-state");
  var toggle = document.getElementById("live-toggle");
  var KEY = "agent_runs.dashboard.paused";
  var timer = null;
  var busy = false;
  var finished = false;
  var paused = false;
  try { paused = window.sessionStorage.getItem(KEY) === "1"; } catch (e) { paused = false; }

  function say(text) { if (state) { state.textContent = text; } }

  function remember(value) {
    try {
      if (value) { window.sessionStorage.setItem(KEY, "1"); }
      else { window.sessionStorage.removeItem(KEY); }
    } catch (e) { /* storage off: paused for this page only */ }
  }

  function showToggle() {
    if (!toggle) { return; }
    toggle.hidden = finished;
    toggle.textContent = paused ? "Resume" : "Pause";
    toggle.setAttribute("aria-pressed", paused ? "true" : "false");
  }

  function schedule() {
    clearTimeout(timer);
    if (finished) { return; }
    if (paused) { say("live: paused"); return; }
    if (document.visibilityState === "visible") {
      timer = setTimeout(refresh, seconds * 1000);
    } else {
      say("live: paused while hidden");
    }
  }

  // The reader is at work in a region: it keeps the focus, holds (part of) a selection, or a
  // box inside it is scrolled away from its start, or runs in it are selected for an action.
  function reading(region) {
    var active = document.activeElement;
    if (active && active !== body && region.contains(active)) { return true; }
    var selection = window.getSelection ? window.getSelection() : null;
    if (selection && !selection.isCollapsed && selection.rangeCount > 0 &&
        selection.containsNode(region, true)) { return true; }
    if (region.querySelector("input[form]:checked")) { return true; }  // runs selected
    var boxes = region.querySelectorAll("pre, .table-wrap, .scroll");
    for (var i = 0; i < boxes.length; i++) {
      if (boxes[i].scrollTop > 0 || boxes[i].scrollLeft > 0) { return true; }
    }
    return false;
  }

  function refresh() {
    if (busy || paused || finished || document.visibilityState !== "visible") {
      schedule();
      return;
    }
    busy = true;
    fetch(window.location.href, { credentials: "same-origin", headers: { "X-Live-Refresh": "1" } })
      .then(function (response) {
        if (!response.ok) { throw new Error("HTTP " + response.status); }
        return response.text();
      })
      .then(function (html) {
        var fresh = new DOMParser().parseFromString(html, "text/html");
        var regions = document.querySelectorAll("[data-live][id]");
        var kept = 0;
        for (var i = 0; i < regions.length; i++) {
          var old = regions[i];
          var next = fresh.getElementById(old.id);
          if (!next || !next.hasAttribute("data-live")) { continue; }
          if (reading(old)) { kept += 1; continue; }
          old.replaceWith(document.importNode(next, true));
        }
        var stamp = new Date();
        finished = !fresh.body.hasAttribute("data-refresh");
        if (finished) {
          say("final: no more refresh");
          body.removeAttribute("data-refresh");
          showToggle();
        } else if (kept) {
          say("live: updated " + stamp.toLocaleTimeString() + " (" + kept +
              " part(s) kept while you read them)");
        } else {
          say("live: updated " + stamp.toLocaleTimeString());
        }
        body.setAttribute("data-refreshed", String(stamp.getTime()));
        body.setAttribute("data-kept", String(kept));
      })
      .catch(function (error) { say("live: refresh failed (" + error.message + "), retrying"); })
      .then(function () { busy = false; schedule(); });
  }

  if (toggle) {
    toggle.addEventListener("click", function () {
      paused = !paused;
      remember(paused);
      showToggle();
      if (paused) { schedule(); } else { say("live: resumed"); refresh(); }
    });
  }
  document.addEventListener("visibilitychange", function () {
    if (document.visibilityState === "visible") { refresh(); } else { schedule(); }
  });
  showToggle();
  schedule();
})();
