// fxstream dashboard: follows /dashboard/events (server-sent events) and swaps each
// section's HTML, which the service renders and escapes (fxstream.service.dashboard_view).
// No build step and nothing fetched from anywhere but this service.
"use strict";

(function () {
  const live = document.getElementById("live");
  const base = location.pathname.replace(/\/+$/, "");
  let source = null;

  function say(text, kind) {
    if (live) {
      live.textContent = text;
      live.className = "live " + kind;
    }
  }

  function clock(seconds) {
    return new Date(seconds * 1000).toISOString().slice(11, 19);
  }

  function apply(snapshot) {
    for (const [name, html] of Object.entries(snapshot.sections)) {
      const target = document.getElementById("section-" + name);
      if (target) {
        target.innerHTML = html;
      }
    }
    say("live · updated " + clock(snapshot.at) + " UTC", "on");
  }

  function connect() {
    source = new EventSource(base + "/events");
    source.addEventListener("snapshot", function (event) {
      apply(JSON.parse(event.data));
    });
    source.addEventListener("logout", function () {
      source.close();
      location.reload();
    });
    source.onerror = function () {
      if (source.readyState === EventSource.CLOSED) {
        // Refused (the session ended, too many streams): the page itself says why.
        say("disconnected", "off");
        setTimeout(function () { location.reload(); }, 3000);
        return;
      }
      // The service ends each stream after a while; EventSource reconnects by itself.
      say("reconnecting", "off");
    };
  }

  connect();
})();
