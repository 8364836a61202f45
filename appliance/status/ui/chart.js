// chat-appliance status page: one small line chart on a canvas, gaps where a value is null.
// Loaded before status.js, which calls drawChart(); no library, nothing fetched.
"use strict";

// style: { colour, label: value → axis text, span: seconds → axis text }
function drawChart(canvas, times, values, style) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || canvas.width, height = canvas.clientHeight || canvas.height;
  canvas.width = width * ratio;
  canvas.height = height * ratio;
  const ctx = canvas.getContext("2d");
  ctx.scale(ratio, ratio);
  ctx.clearRect(0, 0, width, height);
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = "#6b7280";
  const known = values.filter((v) => v != null);
  if (times.length < 2 || known.length === 0) {
    ctx.fillText("no data yet", 10, height / 2);
    return;
  }
  const start = times[0], end = times[times.length - 1], top = niceCeiling(Math.max(...known));
  const pad = { left: 8, right: 8, top: 16, bottom: 16 };
  const x = (t) => pad.left + (t - start) / Math.max(1, end - start) * (width - pad.left - pad.right);
  const y = (v) => height - pad.bottom - v / top * (height - pad.top - pad.bottom);
  ctx.strokeStyle = "#dde1e7";
  ctx.beginPath();
  ctx.moveTo(pad.left, y(0)); ctx.lineTo(width - pad.right, y(0));
  ctx.moveTo(pad.left, y(top)); ctx.lineTo(width - pad.right, y(top));
  ctx.stroke();
  ctx.fillText(style.label(top), pad.left, pad.top - 4);
  ctx.fillText("−" + style.span(end - start), pad.left, height - 3);
  ctx.fillText("now", width - pad.right - 22, height - 3);
  ctx.strokeStyle = style.colour;
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  let drawing = false;
  times.forEach((t, i) => {
    const v = values[i];
    if (v == null) { drawing = false; return; }
    if (drawing) ctx.lineTo(x(t), y(v)); else ctx.moveTo(x(t), y(v));
    drawing = true;
  });
  ctx.stroke();
  // A point with no neighbour draws no line: mark each one so a lone reading shows.
  ctx.fillStyle = style.colour;
  times.forEach((t, i) => {
    if (values[i] != null && values[i - 1] == null && values[i + 1] == null) {
      ctx.fillRect(x(t) - 2, y(values[i]) - 2, 4, 4);
    }
  });
}

function niceCeiling(value) {
  if (value <= 0) return 1;
  const step = Math.pow(10, Math.floor(Math.log10(value)));
  return [1, 2, 5, 10].map((m) => m * step).find((c) => c >= value);
}
