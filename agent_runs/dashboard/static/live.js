// agent_runs dashboard: live refresh. Every few seconds, while the tab is visible, fetch this
// same URL and swap in the regions marked data-live (same id). Paused while the tab is
// hidden. Pages are complete without it.
(function () {
  "use strict";
  var seconds = Number(document.body.getAttribute("data-refresh"));
  if (!seconds || !window.fetch || !window.DOMParser) { return; }
  var state = document.getElementById("live-state");
  var timer = null;
  var busy = false;

  function say(text) { if (state) { state.textContent = text; } }

  function schedule() {
    clearTimeout(timer);
    if (document.visibilityState === "visible") {
      timer = setTimeout(refresh, seconds * 1000);
    } else {
      say("live: paused while hidden");
    }
  }

  function refresh() {
    if (busy || document.visibilityState !== "visible") { schedule(); return; }
    busy = true;
    fetch(window.location.href, { credentials: "same-origin", headers: { "X-Live-Refresh": "1" } })
      .then(function (response) {
        if (!response.ok) { throw new Error("HTTP " + response.status); }
        return response.text();
      })
      .then(function (html) {
        var fresh = new DOMParser().parseFromString(html, "text/html");
        var regions = document.querySelectorAll("[data-live][id]");
        for (var i = 0; i < regions.length; i++) {
          var old = regions[i];
          var next = fresh.getElementById(old.id);
          if (next && next.hasAttribute("data-live") && !old.contains(document.activeElement)) {
            old.replaceWith(document.importNode(next, true));
          }
        }
        var stamp = new Date();
        say("live: updated " + stamp.toLocaleTimeString());
        document.body.setAttribute("data-refreshed", String(stamp.getTime()));
      })
      .catch(function (error) { say("live: refresh failed (" + error.message + "), retrying"); })
      .then(function () { busy = false; schedule(); });
  }

  document.addEventListener("visibilitychange", function () {
    if (document.visibilityState === "visible") { refresh(); } else { schedule(); }
  });
  schedule();
})();
