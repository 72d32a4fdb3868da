// Nightshift console: live progress without polling storms. A page with [data-live] asks for its
// batches' figures with one small request every data-poll-seconds, only while the page is visible
// and some batch on it has not ended; one request at a time, backing off after failures. Forms
// with data-confirm ask first. No other script, nothing loaded from elsewhere.
(function () {
  "use strict";

  function pick(obj, path) {
    return path.split(".").reduce(function (o, k) { return o == null ? undefined : o[k]; }, obj);
  }

  function fill(scope, data) {
    scope.querySelectorAll("[data-field]").forEach(function (el) {
      var value = pick(data, el.getAttribute("data-field"));
      if (value === undefined) return;
      if (el.tagName === "PROGRESS") {
        el.value = value;
        el.textContent = Math.round(value * 100) + "%";
      } else if (el.hasAttribute("data-status")) {   // a status badge: in_progress reads "in progress"
        el.setAttribute("data-status", value);
        el.textContent = String(value).replace(/_/g, " ");
      } else {
        el.textContent = value == null ? "" : String(value);
      }
    });
  }

  function poller(fetchOnce, seconds) {
    var delay = seconds * 1000, timer = null, busy = false;
    function schedule(ms) { clearTimeout(timer); timer = setTimeout(tick, ms); }
    function tick() {
      if (document.hidden) return;              // resumed by visibilitychange
      if (busy) return;
      busy = true;
      fetchOnce().then(function (again) {
        busy = false;
        delay = seconds * 1000;
        if (again) schedule(delay);
      }, function () {
        busy = false;
        delay = Math.min(delay * 2, 60000);      // the server is busy or away: ask less often
        schedule(delay);
      });
    }
    document.addEventListener("visibilitychange", function () { if (!document.hidden) schedule(0); });
    schedule(delay);
  }

  function getJSON(url) {
    return fetch(url, { credentials: "same-origin", headers: { accept: "application/json" } }).then(function (r) {
      if (r.status === 401) { window.location.assign("/console/login"); return new Promise(function () {}); }
      if (!r.ok) throw new Error("HTTP " + r.status);
      return r.json();
    });
  }

  function liveBatches(root) {
    var seconds = parseFloat(root.getAttribute("data-poll-seconds")) || 3;
    var reloadOnEnd = root.getAttribute("data-reload-on-end") === "true";
    var note = document.querySelector("[data-live-note]");
    function running() {
      return Array.prototype.slice.call(root.querySelectorAll("[data-batch][data-terminal='false']"));
    }
    if (!running().length) return;
    poller(function () {
      var rows = running();
      if (!rows.length) return Promise.resolve(false);
      var ids = rows.map(function (r) { return r.getAttribute("data-batch"); });
      return getJSON(root.getAttribute("data-live") + "?ids=" + ids.map(encodeURIComponent).join(",")).then(function (body) {
        var ended = false;
        rows.forEach(function (row) {
          var data = body.batches[row.getAttribute("data-batch")];
          if (!data) return;
          fill(row, data);
          if (data.terminal) { row.setAttribute("data-terminal", "true"); ended = true; }
        });
        if (note) note.classList.remove("stale");
        if (ended && reloadOnEnd) { window.location.reload(); return false; }
        return running().length > 0;
      }, function (err) {
        if (note) note.classList.add("stale");
        throw err;
      });
    }, seconds);
  }

  function liveHealth(root) {
    var seconds = parseFloat(root.getAttribute("data-poll-seconds")) || 5;
    poller(function () {
      return getJSON(root.getAttribute("data-health")).then(function (body) { fill(root, body); return true; });
    }, seconds);
  }

  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("[data-live]").forEach(liveBatches);
    document.querySelectorAll("[data-health]").forEach(liveHealth);
    document.querySelectorAll("form[data-confirm]").forEach(function (form) {
      form.addEventListener("submit", function (event) {
        var question = form.getAttribute("data-confirm");
        if (question && !window.confirm(question)) event.preventDefault();
      });
    });
  });
})();
