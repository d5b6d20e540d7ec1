// Numbers and times as the dashboard shows them; sizes exactly as `ckptd ls` prints
// them (ckptd/knobs.py human_bytes), so one step reads the same on both.
"use strict";

window.ckptdFormat = (function () {
  // Python's "%.1f": the exact double rounded, a tie to the even digit. toFixed is
  // exact too but rounds a tie up; a tie is v = j/4 with j odd (x.25, x.75), then
  // v*10 = 5j/2, done in BigInt so a huge v stays exact.
  function fixed1(v) {
    const q = v * 4;  // exact: a power of two
    if (!Number.isInteger(q) || q % 2 === 0) return v.toFixed(1);
    const low = (BigInt(q) * 5n - 1n) / 2n;  // the two tenths either side
    const n = low % 2n === 0n ? low : low + 1n;
    return `${n / 10n}.${n % 10n}`;
  }

  function bytes(n) {
    if (n === null || n === undefined) return "–";
    let v = Number(n);
    for (const unit of ["B", "KiB", "MiB", "GiB"]) {
      if (v < 1024) return unit === "B" ? `${v.toFixed(0)} B` : `${fixed1(v)} ${unit}`;
      v /= 1024;
    }
    return `${fixed1(v)} TiB`;
  }
  function count(n) { return n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US"); }
  function age(s) {
    if (s === null || s === undefined) return "–";
    if (s < 10) return `${s.toFixed(1)} s ago`;
    if (s < 120) return `${Math.round(s)} s ago`;
    if (s < 7200) return `${Math.round(s / 60)} min ago`;
    return `${Math.round(s / 3600)} h ago`;
  }
  function clock(ts) {
    if (!ts) return "–";
    return new Date(ts * 1000).toLocaleTimeString("en-GB", { hour12: false });
  }
  function stamp(ts) {
    if (!ts) return "–";
    return new Date(ts * 1000).toISOString().replace("T", " ").slice(0, 19) + " UTC";
  }
  return Object.freeze({ bytes, count, age, clock, stamp });
})();
