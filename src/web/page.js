// locketd's web page: refreshes the sections from /api/page every 2 s. Every text from Redis
// is set as textContent, never as HTML. Mirrors src/web/page.rs (the first render).
"use strict";
(function () {
  var MAX_ROWS = 500;
  var SERIES = [["processed", "processed"], ["failed", "failed"], ["started", "started"],
                ["conflict", "lock conflicts"], ["conflict_failed", "conflict failures"],
                ["queue_skipped", "queue skips"]];
  var COLOURS = ["#2f855a", "#c53030", "#2b6cb0", "#c05621", "#b83280", "#6b46c1"];
  var actions = document.body.getAttribute("data-actions") === "on";
  var refreshes = 0;

  function s(v) {
    if (v === null || v === undefined) return "";
    if (typeof v === "string") return v;
    return JSON.stringify(v);
  }
  function human(ms) {
    if (typeof ms !== "number" || ms < 0) return "-";
    var x = Math.floor(ms / 1000);
    if (x < 60) return x + "." + Math.floor((ms % 1000) / 100) + "s";
    if (x < 3600) return Math.floor(x / 60) + "m" + String(x % 60).padStart(2, "0") + "s";
    return Math.floor(x / 3600) + "h" + String(Math.floor((x % 3600) / 60)).padStart(2, "0") + "m";
  }
  // "12:00:03.250" (UTC) for epoch ms, as `locketd limits` prints it.
  function clock(ms) { return new Date(ms).toISOString().slice(11, 23); }
  function secs(v) { return typeof v === "number" ? human(v * 1000) : "-"; }
  function at(epoch) { return new Date(epoch * 1000).toISOString().replace(".000Z", "Z"); }
  function button(label, endpoint, body) {
    var b = document.createElement("button");
    b.type = "button"; b.className = "act"; b.textContent = label;
    b.setAttribute("data-endpoint", endpoint);
    b.setAttribute("data-body", JSON.stringify(body));
    return b;
  }

  // A slot's handler, as src/web/handler_cell.rs writes it: with threads (H-18), the thread of
  // the slot's job and its process's threads busy / total, jobs and memory.
  function handlerCell(h) {
    var threads = typeof h.threads === "number" ? h.threads : 1;
    var state = !h.ready ? "not ready" : threads > 1 && h.retiring ? "retiring" : "ready";
    var out = s(h.name) + " pid " + (h.pid === null || h.pid === undefined ? "-" : s(h.pid)) + " " + state;
    if (threads > 1) {
      if (typeof h.thread === "number") out += ", thread " + h.thread;
      var memory = typeof h.rss_bytes === "number" ? (h.rss_bytes / 1048576).toFixed(1) + "MiB" : "-";
      out += " (" + (h.threads_busy || 0) + "/" + threads + " busy, " + (h.jobs || 0) + " jobs, " + memory + ")";
    }
    return out;
  }

  // The queue row's actions: reset its lock counter; pause or resume it.
  function queueActions(q) {
    var cell = document.createElement("span");
    if (q.counter !== null) {
      cell.appendChild(button("reset counter", "/api/counters/reset", {queue: q.name}));
      cell.appendChild(document.createTextNode(" "));
    }
    if (q.paused === "queue") cell.appendChild(button("resume", "/api/queues/resume", {queue: q.name}));
    else if (q.paused === "running") cell.appendChild(button("pause", "/api/queues/pause", {queue: q.name}));
    return cell;
  }

  var rowsOf = {
    queues: function (v) {
      return v.rows.map(function (q) {
        var state = q.paused === "all" ? "paused (every queue)" : q.paused === "queue" ? "paused"
          : q.skipped ? "skipped (every job waits on a lock)" : q.length === 0 ? "empty"
          : q.counter > 0 ? "draining (" + q.counter + " of " + q.length + " wait on a lock)" : "ok";
        if (q.configured === false) state += "; not worked here";
        return [q.name, s(q.length), s(q.parked_jobs || 0), q.counter === null ? "-" : s(q.counter), state,
                s(q.head_class), secs(q.oldest_age_secs),
                actions ? queueActions(q) : ""];
      });
    },
    workers: function (v) {
      return v.rows.map(function (w) {
        var job = w.job || {};
        var state = w.parked ? "parked: " + s(w.parked.why) : w.job ? "busy" : "idle";
        var hs = (w.handlers || []).map(handlerCell);
        return [w.id, s(w.kind), s(w.queues), state, s(job.class), s(job.run_at), secs(job.running_secs), hs.join("; "),
                actions && w.kind === "locketd" && w.job ? button("cancel", "/api/jobs/cancel", {target: w.id}) : ""];
      });
    },
    locks: function (v) {
      var out = [];
      v.rows.forEach(function (l) {
        var parts = [];
        if (l.waiting) parts.push(s(l.waiting.class) + " on " + s(l.waiting.queue) + " (attempt " + s(l.waiting.attempt) + ", due in " + human(l.waiting.due_in_ms) + ")");
        if (l.blocked_queues && l.blocked_queues.length) parts.push("queues skipping: " + l.blocked_queues.join(", "));
        (l.holders || []).forEach(function (h) {
          out.push([l.lock_id, s(h.token).slice(0, 8), s(h.resque_worker), s(h.class), human(h.age_ms), human(h.left_ms), s(h.limit), s(h.fence), parts.join("; "),
                    actions ? button("release", "/api/locks/release", {lock_id: l.lock_id, token: h.token}) : ""]);
        });
      });
      return out;
    },
    holds: function (v) {
      return v.rows.map(function (h) {
        var q = h.blocked_queues || [];
        return [h.name, s(h.digest).slice(0, 12), s(h.count), human(h.left_ms), q.length ? "queues skipping: " + q.join(", ") : ""];
      });
    },
    rates: function (v) {
      return v.rows.map(function (r) {
        var known = r.template !== null && r.template !== undefined;
        var next = typeof r.next_allowed_ms === "number" && r.next_allowed_ms > v.now_ms ? clock(r.next_allowed_ms) : "now";
        return [s(r.key), known ? s(r.limit) : "?", known ? human(r.period_ms) : "?", s(r.used),
                known ? s(r.allowed_now) : "?", next,
                typeof r.closed_until_ms === "number" ? clock(r.closed_until_ms) : "-", s(r.parked)];
      });
    },
    delayed: function (v) {
      var out = v.rows.map(function (d) {
        return [s(d.rid), s(d.queue), s(d.class), s(d.reason) + " " + s(d.resource), s(d.attempt), human(d.due_in_ms)];
      });
      ((v.scheduler || {}).rows || []).forEach(function (d) {
        out.push(["resque-scheduler", s(d.queue), s(d.class), "args " + s(d.args), "-", typeof d.at === "number" ? at(d.at) : "-"]);
      });
      return out;
    },
    schedules: function (v) {
      return v.rows.map(function (r) {
        var c = r.config || {};
        var when = c.when ? s(c.when) : c.cron ? "cron " + s(c.cron) : c.every ? "every " + s(c.every) : "";
        var run = actions && r.source === "locketd" ? button("run now", "/api/schedules/run", {name: r.name}) : "";
        return [r.name, when, s(c.class), s(c.queue), typeof r.next === "number" ? at(r.next) : "-",
                s(r.last_enqueued_at), run];
      });
    },
    failures: function (v) {
      return v.rows.map(function (f) {
        var body = {list: f.list, index: f.index};
        var cell = "";
        if (actions) {
          cell = document.createDocumentFragment();
          cell.appendChild(button("retry", "/api/failures/retry", body));
          cell.appendChild(document.createTextNode(" "));
          cell.appendChild(button("remove", "/api/failures/remove", body));
        }
        return [s(f.failed_at), s(f.list), s(f.queue), s(f.class), s(f.exception), s(f.error), cell];
      });
    }
  };

  function hasData(name, v) {
    if (v.unreadable && v.unreadable.length) return true;
    if (name === "chart" || name === "queues" || name === "workers") return true;
    if (name === "delayed") return v.total > 0 || (v.scheduler && v.scheduler.total > 0);
    if (name === "schedules") return v.total > 0 || !!v.master_lock;
    return v.total > 0;
  }
  function countText(name, v) {
    if (name === "chart") return "";
    var shown = (v.rows || []).length;
    var t = v.total > shown && shown >= MAX_ROWS ? shown + " of " + v.total : String(v.total);
    if (name === "delayed" && v.scheduler && v.scheduler.total > 0) t += " + " + v.scheduler.total + " resque-scheduler";
    return t;
  }
  // The keys a section (or the status line) could not read, as page.rs writes them.
  function showUnreadable(id, list) {
    var e = document.getElementById(id);
    if (!e) return;
    var lines = (list || []).map(function (u) { return s(u.key) + ": " + s(u.error); });
    e.textContent = lines.length ? "could not read " + lines.join("; ") : "";
    e.hidden = !lines.length;
  }
  function fillBody(tbody, rows) {
    var frag = document.createDocumentFragment();
    rows.forEach(function (r) {
      var tr = document.createElement("tr");
      r.forEach(function (c) {
        var td = document.createElement("td");
        if (typeof c === "string") td.textContent = c; else if (c) td.appendChild(c);
        tr.appendChild(td);
      });
      frag.appendChild(tr);
    });
    tbody.replaceChildren(frag);
  }
  function svg(tag, attrs) {
    var e = document.createElementNS("http://www.w3.org/2000/svg", tag);
    Object.keys(attrs).forEach(function (k) { e.setAttribute(k, attrs[k]); });
    return e;
  }
  function drawChart(v) {
    var w = 900, h = 180, pad = 24;
    var max = 1;
    var series = v.series || {};
    var points = function (ev) { return (series[ev] || {}).points || []; };
    SERIES.forEach(function (x) { points(x[0]).forEach(function (p) { if (p > max) max = p; }); });
    var note = document.querySelector("#chart .note");
    if (note) note.textContent = s(v.note);
    var root = svg("svg", {id: "chart-svg", xmlns: "http://www.w3.org/2000/svg", viewBox: "0 0 " + w + " " + (h + 2 * pad + 16), role: "img", "aria-label": "jobs per minute"});
    root.appendChild(svg("line", {x1: pad, y1: h + pad, x2: w - pad, y2: h + pad, "class": "axis"}));
    var t1 = svg("text", {x: 2, y: pad + 4, "class": "tick"}); t1.textContent = String(max); root.appendChild(t1);
    var t0 = svg("text", {x: 2, y: h + pad, "class": "tick"}); t0.textContent = "0"; root.appendChild(t0);
    var ta = svg("text", {x: pad, y: h + pad + 13, "class": "tick"}); ta.textContent = "60 min ago"; root.appendChild(ta);
    var tb = svg("text", {x: w - pad, y: h + pad + 13, "class": "tick", "text-anchor": "end"}); tb.textContent = "now"; root.appendChild(tb);
    SERIES.forEach(function (x, i) {
      var p = points(x[0]).map(function (y) { return y || 0; });
      var n = Math.max(p.length, 2) - 1, total = 0;
      var coords = p.map(function (y, j) {
        total += y;
        return (pad + (w - 2 * pad) * j / n).toFixed(1) + "," + (pad + h - h * y / max).toFixed(1);
      });
      var c = COLOURS[i % COLOURS.length];
      root.appendChild(svg("polyline", {fill: "none", stroke: c, "stroke-width": 2, points: coords.join(" ")}));
      var l = svg("text", {x: pad + 145 * i, y: h + 2 * pad + 12, fill: c, "class": "legend"});
      l.textContent = x[1] + " (" + total + ")";
      root.appendChild(l);
    });
    document.getElementById("chart-svg").replaceWith(root);
  }
  function byClass(v) {
    var t = document.querySelector("#failures table.by-class tbody");
    if (t) fillBody(t, (v.by_class || []).map(function (b) { return [s(b.class), s(b.exception), s(b.count)]; }));
  }
  function apply(page) {
    var st = page.summary;
    var set = function (id, val) { var e = document.getElementById(id); if (e) e.textContent = String(val); };
    set("s-processed", st.processed); set("s-failed", st.failed); set("s-failures", st.failures_listed);
    set("s-locks", st.locks_held); set("s-workers", st.workers); set("s-busy", st.busy);
    showUnreadable("s-unreadable", st.unreadable);
    Object.keys(page.sections).forEach(function (name) {
      var v = page.sections[name];
      var sec = document.getElementById(name);
      if (!sec) return;
      sec.hidden = !hasData(name, v);
      var count = sec.querySelector("h2 .count");
      if (count) count.textContent = countText(name, v);
      showUnreadable(name + "-unreadable", v.unreadable);
      if (name === "chart") { drawChart(v); return; }
      if (name === "failures") byClass(v);
      if (name === "schedules") {
        var ml = document.getElementById("master-lock");
        if (ml) ml.textContent = "scheduler lock: " + (v.master_lock ? "held by " + s(v.master_lock.holder) + " (" + s(v.master_lock.ttl_secs) + "s left)" : "not held");
      }
      var body = document.getElementById(name + "-rows");
      if (body && rowsOf[name]) fillBody(body, rowsOf[name](v));
    });
    refreshes += 1;
    var r = document.getElementById("refreshed");
    r.textContent = "refreshed at " + at(st.now);
    r.setAttribute("data-refreshes", String(refreshes));
  }
  function refresh() {
    fetch("/api/page", {cache: "no-store"})
      .then(function (resp) { if (!resp.ok) throw new Error("HTTP " + resp.status); return resp.json(); })
      .then(apply)
      .catch(function (e) { document.getElementById("refreshed").textContent = "refresh failed: " + e.message; })
      .finally(function () { setTimeout(refresh, 2000); });
  }
  if (actions) {
    var form = document.getElementById("token-form");
    if (form) form.hidden = false;
    document.addEventListener("click", function (ev) {
      var b = ev.target.closest ? ev.target.closest("button.act") : null;
      if (!b) return;
      var token = document.getElementById("token").value;
      var out = document.getElementById("action-result");
      fetch(b.getAttribute("data-endpoint"), {
        method: "POST",
        headers: {"Authorization": "Bearer " + token, "Content-Type": "application/json"},
        body: b.getAttribute("data-body")
      }).then(function (resp) {
        return resp.text().then(function (t) { out.textContent = resp.status + " " + t; });
      }).catch(function (e) { out.textContent = "failed: " + e.message; });
    });
  }
  setTimeout(refresh, 2000);
})();
