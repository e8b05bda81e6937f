// kumiko dashboard: a little progressive JavaScript. Every page works without it.
// - "live": reloads the data of the page (its <main>) every few seconds, while the tab is
//   visible and nothing in it has the focus; off until switched on, remembered per browser.
// - forms with data-confirm ask before they post.
(function () {
  "use strict";
  var KEY = "kumiko-dashboard-live";

  document.addEventListener("submit", function (event) {
    var question = event.target.getAttribute("data-confirm");
    if (question && !window.confirm(question)) {
      event.preventDefault();
    }
  });

  var main = document.querySelector("main[data-refresh]");
  var box = document.getElementById("live");
  if (!main || !box) {
    return;
  }
  box.parentElement.hidden = false;
  var stored = null;
  try {
    stored = window.localStorage.getItem(KEY);
  } catch (ignored) {
    stored = null;
  }
  box.checked = stored === "on";
  box.addEventListener("change", function () {
    try {
      window.localStorage.setItem(KEY, box.checked ? "on" : "off");
    } catch (ignored) {
      // private mode: live stays on for this page only
    }
  });

  var seconds = Math.max(1, parseInt(main.getAttribute("data-refresh"), 10) || 5);
  var busy = false;

  function openDetails() {
    var open = [];
    main.querySelectorAll("details").forEach(function (node, index) {
      if (node.open) {
        open.push(index);
      }
    });
    return open;
  }

  function refresh() {
    if (!box.checked || busy || document.hidden) {
      return;
    }
    var focused = document.activeElement;
    if (focused && focused !== document.body && main.contains(focused)) {
      return;
    }
    busy = true;
    var open = openDetails();
    fetch(window.location.href, { credentials: "same-origin", headers: { Accept: "text/html" } })
      .then(function (response) {
        return response.ok && !response.redirected ? response.text() : null;
      })
      .then(function (html) {
        if (html === null) {
          return;
        }
        var fresh = new DOMParser().parseFromString(html, "text/html").querySelector("main");
        if (!fresh) {
          return;
        }
        main.replaceChildren.apply(main, Array.prototype.slice.call(fresh.childNodes));
        var details = main.querySelectorAll("details");
        open.forEach(function (index) {
          if (details[index]) {
            details[index].open = true;
          }
        });
      })
      .catch(function () {
        // the server is away: try again next time
      })
      .then(function () {
        busy = false;
      });
  }

  window.setInterval(refresh, seconds * 1000);
})();
