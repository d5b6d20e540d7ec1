// The ckptd dashboard: fetches v1/overview every few seconds and draws it.
// Everything a client sent (job names, reasons, signals) is set as text, never as HTML.
"use strict";

(function () {
  const TOKEN_KEY = "ckptd-token";
  const refreshMs = Number(document.body.dataset.refreshMs) || 3000;
  const $ = (id) => document.getElementById(id);
  let timer = null;

  // Probe signals shown in columns (docs/API.md): one reading per instance, named
  // name[instance] (gpu_temperature_c[0], ...); the hottest GPU, the sum of ECC errors.
  const SIGNALS = {
    temp: { names: ["gpu_temperature_c", "gpu_temp_c"], combine: Math.max },
    ecc: { names: ["gpu_ecc_uncorrected_volatile", "gpu_ecc_errors"], combine: (a, b) => a + b },
    mem: { names: ["host_memory_percent", "host_mem_pct"], combine: Math.max },
  };

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") node.className = v;
      else if (k === "style") node.style.cssText = v;  // CSSOM: allowed by the CSP
      else node.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children.flat()) {
      if (c === null || c === undefined) continue;
      node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return node;
  }

  const { bytes, count, age, clock, stamp } = window.ckptdFormat;  // format.js

  function signal(health, kind) {
    const signals = (health && health.signals) || {};
    const { names, combine } = SIGNALS[kind];
    let found = null;
    for (const [key, value] of Object.entries(signals)) {
      const base = key.replace(/\[.*\]$/, "");
      if (!names.includes(base) || value === null) continue;
      if (typeof value !== "number") { found = found === null ? value : found; continue; }
      found = typeof found === "number" ? combine(found, value) : value;
    }
    return found;
  }
  function signalList(health) {
    const signals = (health && health.signals) || {};
    return Object.entries(signals).map(([k, v]) => `${k} = ${v}`).join("\n");
  }
  function reasonClass(reason) {
    if (!reason || reason === "periodic") return "reason-periodic";
    if (reason === "health" || reason === "manual") return `reason-${reason}`;
    return "reason-other";
  }

  function headers() {
    const token = sessionStorage.getItem(TOKEN_KEY);
    return token ? { Authorization: `Bearer ${token}` } : {};
  }

  async function refresh() {
    clearTimeout(timer);
    try {
      const r = await fetch("v1/overview", { headers: headers(), cache: "no-store" });
      if (r.status === 401) {
        showLogin(sessionStorage.getItem(TOKEN_KEY) ? "That token was refused." : null);
        return;
      }
      if (!r.ok) {
        let message = `HTTP ${r.status}`;
        try { message = (await r.json()).message || message; } catch (e) { /* not JSON */ }
        throw new Error(message);
      }
      const data = await r.json();
      $("login").hidden = true;
      $("error").hidden = true;
      $("signout").hidden = !sessionStorage.getItem(TOKEN_KEY);
      render(data);
      $("updated").textContent = `updated ${clock(Date.now() / 1000)}`;
    } catch (err) {
      $("error").hidden = false;
      $("error").textContent = `Cannot reach the server: ${err.message}`;
      $("updated").textContent = "offline";
    }
    timer = setTimeout(refresh, refreshMs);
  }

  function showLogin(message) {
    $("login").hidden = false;
    $("storage").replaceChildren();
    $("jobs").replaceChildren();
    $("empty").hidden = true;
    $("empty-scoped").hidden = true;
    $("updated").textContent = "locked";
    $("login-error").hidden = !message;
    $("login-error").textContent = message || "";
    $("token").focus();
  }

  function stat(label, value, sub) {
    return el("div", { class: "card stat" },
      el("div", { class: "label" }, label),
      el("div", { class: "value" }, value),
      sub ? el("div", { class: "sub" }, sub) : null);
  }

  // The store and its counters are the operator's (a token on every job): to any
  // other token the server sends no store and zeroed counters (docs/SECURITY.md).
  function storageCards(data) {
    const s = data.storage;
    if (!data.store) {
      return [stat("Store counters", "operator only", "a token on every job (*) sees them")];
    }
    const dedup = s.dedup_ratio === null ? "–" : `${s.dedup_ratio.toFixed(2)}×`;
    return [
      stat("Stored", bytes(s.bytes_stored), `${count(s.chunks_stored)} new chunks`),
      stat("Dedup", dedup, `${count(s.chunks_offered)} ids offered, ${count(s.chunks_missing)} sent`),
      stat("Uploads", bytes(s.upload_bytes), `${count(s.uploads)} chunks, ${count(s.rejected_uploads)} refused`),
      stat("Restores", bytes(s.restore_bytes), `${count(s.restores)} chunks read`),
      stat("Commits", count(s.commits), `since ${stamp(s.since)}`),
    ];
  }

  function render(data) {
    $("store").textContent = data.store;
    $("storage").replaceChildren(
      stat("Jobs", count(data.jobs.length),
        `${count(data.jobs.reduce((n, j) => n + j.ranks.filter(
          (r) => r.state !== "dead" && r.state !== "left").length, 0))} ranks reporting`),
      ...storageCards(data));
    const scrolled = timelineScrolls();
    $("jobs").replaceChildren(...data.jobs.map(renderJob));
    keepTimelineScrolls(scrolled);
    $("empty").hidden = data.jobs.length > 0 || !data.store;
    $("empty-scoped").hidden = data.jobs.length > 0 || Boolean(data.store);
  }

  // Each refresh draws the timelines anew: a job's strip keeps where its user
  // scrolled it, and shows its newest steps (the end) when first drawn or when the
  // user was at the end.
  function timelineScrolls() {
    const found = new Map();
    for (const strip of $("jobs").querySelectorAll("article.job .timeline")) {
      const atEnd = strip.scrollLeft + strip.clientWidth >= strip.scrollWidth - 2;
      found.set(strip.closest("article.job").dataset.job, atEnd ? null : strip.scrollLeft);
    }
    return found;
  }
  function keepTimelineScrolls(scrolled) {
    for (const strip of $("jobs").querySelectorAll("article.job .timeline")) {
      const left = scrolled.get(strip.closest("article.job").dataset.job);
      strip.scrollLeft = left === undefined || left === null ? strip.scrollWidth : left;
    }
  }

  function renderJob(job) {
    const states = { alive: 0, degraded: 0, critical: 0, dead: 0, left: 0 };
    for (const r of job.ranks) states[r.state] += 1;
    const head = el("div", { class: "job-head" },
      el("h2", {}, job.job),
      el("span", { class: "pill pill-neutral" }, `world ${job.world_size ?? "?"}`),
      job.damaged || job.unsupported
        ? el("span", { class: "pill pill-dead", title: job.damaged || job.unsupported },
          job.damaged ? "latest damaged" : "newer format: upgrade ckptd")
        : el("span", { class: "pill pill-neutral" }, `latest ${job.latest ?? "none"}`),
      ...Object.entries(states).filter(([, n]) => n > 0).map(([state, n]) =>
        el("span", { class: `pill pill-${state}` }, el("span", { class: "dot" }), `${n} ${state}`)),
      job.snapshot_at !== null
        ? el("span", { class: "pill pill-snapshot" },
          `snapshot pending at step ${job.snapshot_at}` + (job.snapshot_reason ? ` · ${job.snapshot_reason}` : ""))
        : null,
      job.rollback_to !== null
        ? el("span", { class: "pill pill-rollback" }, `rollback to step ${job.rollback_to}`)
        : null,
    );
    const main = el("div", { class: "job-main" },
      el("h3", {}, "Ranks"), renderRanks(job),
      el("h3", {}, "Checkpoints"), renderTimeline(job), renderSteps(job));
    const side = el("div", { class: "job-side" }, el("h3", {}, "Events"), renderEvents(job));
    return el("article", { class: "card job", "data-job": job.job }, head,
      el("div", { class: "job-body" }, main, side));
  }

  // Column titles; a leading "#" marks a numeric (right-aligned) column.
  function header(titles) {
    return el("thead", {}, el("tr", {}, ...titles.map((t) =>
      t.startsWith("#") ? el("th", { class: "num" }, t.slice(1)) : el("th", {}, t))));
  }

  function renderRanks(job) {
    if (!job.ranks.length) return el("p", { class: "muted", style: "margin: 0 18px" }, "No heartbeats from this job's ranks.");
    const rows = job.ranks.map((r) => {
      const temp = signal(r.health, "temp");
      const ecc = signal(r.health, "ecc");
      const mem = signal(r.health, "mem");
      const reasons = (r.health && r.health.reasons) || [];
      return el("tr", { class: `row-${r.state}`, "data-rank": r.rank, "data-state": r.state },
        el("td", { class: "num" }, r.rank),
        el("td", {}, el("span", { class: `pill pill-${r.state}` }, el("span", { class: "dot" }), r.state)),
        el("td", { class: "num" }, r.step ?? "–"),
        el("td", { class: "num" }, r.held_step ?? "–"),
        el("td", { class: r.state === "dead" ? "crit-text" : "" }, age(r.age_s)),
        el("td", { class: "num" + (typeof temp === "number" && temp >= 85 ? " warn-text" : "") },
          temp === null ? "–" : (typeof temp === "number" ? `${temp.toFixed(0)} °C` : temp)),
        el("td", { class: "num" + (typeof ecc === "number" && ecc > 0 ? " crit-text" : "") }, ecc ?? "–"),
        el("td", { class: "num" }, mem === null ? "–" : (typeof mem === "number" ? `${mem.toFixed(0)} %` : mem)),
        el("td", { class: "num" }, r.rtt_ms === null ? "–" : `${r.rtt_ms.toFixed(1)} ms`),
        el("td", { class: "reasons", title: signalList(r.health) || null },
          reasons.length ? reasons.join("; ")
            : (r.state === "dead" ? "no heartbeat" : r.state === "left" ? "closed" : "")),
      );
    });
    return el("div", { class: "table-wrap" }, el("table", { class: "ranks" },
      header(["#Rank", "State", "#Step", "#Held", "Heartbeat", "#GPU temp", "#ECC", "#Host mem", "#RTT", "Reasons"]),
      el("tbody", {}, rows)));
  }

  function renderTimeline(job) {
    if (!job.steps.length) return el("p", { class: "muted", style: "margin: 0 18px" }, "No checkpoints yet.");
    const sizes = job.steps.map((s) => s.logical_bytes || 0);
    const biggest = Math.max(1, ...sizes);
    const ticks = job.steps.map((s) => {
      const h = s.committed ? 18 + Math.round(42 * (s.logical_bytes || 0) / biggest) : 24;
      const broken = s.damaged || s.unsupported;
      const cls = ["bar", broken ? "damaged" : s.committed ? reasonClass(s.reason) : "pending",
        s.is_latest ? "latest" : ""].join(" ");
      const title = broken
        ? `step ${s.step} · ${s.damaged ? "damaged" : "newer format: upgrade ckptd"} · ${broken}`
        : s.committed
        ? `step ${s.step} · ${s.reason || "periodic"} · ${bytes(s.logical_bytes)} · ${stamp(s.committed_at)}`
        : `step ${s.step} · pending · ${s.ranks_present}/${s.world_size ?? "?"} ranks`;
      return el("div", { class: "tick", title, "data-step": s.step }, el("div", { class: cls, style: `height:${h}px` }),
        el("div", { class: "label" }, s.step));
    });
    const legend = el("div", { class: "legend" },
      ...[["periodic", "var(--periodic)"], ["health", "var(--health)"], ["manual", "var(--manual)"]]
        .map(([name, color]) => el("span", {}, el("span", { class: "sw", style: `background:${color}` }), name)),
      el("span", {}, el("span", { class: "sw", style: "background:#d1d5db" }), "pending"),
      job.steps.some((s) => s.damaged || s.unsupported)
        ? el("span", {}, el("span", { class: "sw", style: "background:var(--dead)" }), "damaged") : null);
    return el("div", {}, el("div", { class: "timeline" }, ticks), legend);
  }

  function renderSteps(job) {
    const rows = job.steps.slice().reverse().slice(0, 8).map((s) => el("tr", { "data-step": s.step },
      el("td", { class: "num" }, s.step),
      el("td", {}, s.damaged || s.unsupported
        ? el("span", { class: "pill pill-dead", title: s.damaged || s.unsupported },
          s.damaged ? "damaged" : "newer format")
        : s.committed
        ? el("span", { class: "pill pill-alive" }, s.is_latest ? "committed · latest" : "committed")
        : el("span", { class: "pill pill-neutral" }, `pending ${s.ranks_present}/${s.world_size ?? "?"}`)),
      el("td", {}, s.committed ? el("span", { class: `reason ${reasonClass(s.reason)}` }, s.reason || "periodic") : "–",
        s.requested_by !== null && s.requested_by !== undefined ? el("span", { class: "muted" }, ` by rank ${s.requested_by}`) : null),
      el("td", { class: "num" }, bytes(s.logical_bytes)),
      el("td", { class: "muted" }, stamp(s.committed_at)),
    ));
    if (!rows.length) return null;
    return el("div", { class: "table-wrap", style: "margin-top: 10px" }, el("table", { class: "steps" },
      header(["#Step", "State", "Why", "#Size", "Committed"]),
      el("tbody", {}, rows)));
  }

  const EVENT_TEXT = {
    snapshot_requested: (e) => `snapshot asked for at step ${e.step}` + (e.rank !== null ? ` by rank ${e.rank}` : ""),
    snapshot_committed: (e) => `coordinated snapshot committed (step ${e.step})`,
    snapshot_expired: (e) => `snapshot target ${e.step} expired`,
    snapshot_dropped: (e) => `snapshot target ${e.step} dropped (rollback)`,
    rollback_set: (e) => `rollback to step ${e.step}`,
    rollback_cleared: () => "rollback cleared",
    rank_dead: (e) => `rank ${e.rank} dead`,
    rank_back: (e) => `rank ${e.rank} back`,
    rank_left: (e) => `rank ${e.rank} left` + (e.step !== null ? ` at step ${e.step}` : ""),
    restore_fallback: (e) => `rank ${e.rank} restores step ${e.step}, older than latest`,
    launch_conflict: () => "two launches of the job beat at once (two jobs with one name?)",
  };

  function renderEvents(job) {
    if (!job.events.length) return el("p", { class: "muted" }, "Nothing has happened yet.");
    return el("ul", { class: "events" }, job.events.slice().reverse().slice(0, 12).map((e) =>
      el("li", {},
        el("div", { class: "when" }, clock(e.at)),
        el("span", { class: `kind kind-${e.kind}` }, (EVENT_TEXT[e.kind] || ((x) => x.kind))(e)),
        e.reason ? el("div", { class: "muted" }, e.reason) : null)));
  }

  $("login-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, $("token").value.trim());
    $("token").value = "";
    refresh();
  });
  $("signout").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    refresh();
  });
  document.addEventListener("visibilitychange", () => { if (!document.hidden) refresh(); });
  refresh();
})();
