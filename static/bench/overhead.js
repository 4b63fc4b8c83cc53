// Where a decode step's fixed time goes in a browser's WebGPU: synthetic steps in plain JS.
//
// A "step" mirrors a decode step of the engine: one compute pass of D dependent dispatches (each
// reads and writes one shared state buffer, so every dispatch waits for the one before), each with
// its own bind group (or one shared), then a 4-byte copy into a host-readable staging buffer.
// The host keeps Q submits in flight, each holding K steps, and reads each submit's staging
// buffer with mapAsync (or waits with onSubmittedWorkDone, or never reads until the end).
// Timestamp queries around every pass give the GPU's busy time per step and the GPU's idle gap
// between steps, next to the wall time per step. Runs in a page or a worker (overhead.html).
"use strict";

const OVERHEAD_TINY = `
@group(0) @binding(0) var<storage, read_write> acc: array<u32>;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@compute @workgroup_size(64) fn main(@builtin(global_invocation_id) g: vec3u) {
  if (g.x == 0u) { acc[0] = acc[0] + w[0] + 1u; }
}`;

// A dispatch with real GPU time: 264 workgroups x 256 threads of dependent FMAs (ITER per thread).
const overheadWork = (iter) => `
@group(0) @binding(0) var<storage, read_write> acc: array<u32>;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@compute @workgroup_size(256) fn main(@builtin(global_invocation_id) g: vec3u) {
  var x = f32(g.x) + f32(acc[0] & 1u);
  for (var i = 0u; i < ${iter}u; i++) { x = fma(x, 1.0000001, 0.5); }
  if (x == -1.0) { acc[1] = u32(x); }
  if (g.x == 0u) { acc[0] = acc[0] + w[0] + 1u; }
}`;

function median(values) {
  const s = [...values].sort((a, b) => a - b);
  return s.length ? s[s.length >> 1] : NaN;
}

async function overheadSetup(device, maxD) {
  const S = GPUBufferUsage;
  const acc = device.createBuffer({ size: 256, usage: S.STORAGE | S.COPY_SRC | S.COPY_DST });
  const weights = [];
  for (let d = 0; d < maxD; d++) {
    const b = device.createBuffer({ size: 4096, usage: S.STORAGE | S.COPY_DST });
    device.queue.writeBuffer(b, 0, new Uint32Array([d]));
    weights.push(b);
  }
  const pipelines = {};
  const bindGroups = {};
  const make = async (name, code, wgSize) => {
    const module = device.createShaderModule({ code });
    const p = await device.createComputePipelineAsync({ layout: "auto", compute: { module, entryPoint: "main" } });
    pipelines[name] = p;
    bindGroups[name] = weights.map((w) => device.createBindGroup({
      layout: p.getBindGroupLayout(0),
      entries: [{ binding: 0, resource: { buffer: acc } }, { binding: 1, resource: { buffer: w } }],
    }));
    return p;
  };
  await make("tiny", OVERHEAD_TINY);
  return { acc, weights, pipelines, bindGroups, make };
}

// One experiment: `steps` steps (after `warm`), returns wall ms/step and GPU timestamps.
async function overheadRun(device, env, cfg) {
  const { D = 185, Q = 2, K = 1, kernel = "tiny", bg = "distinct", wait = "map", steps = 300, warm = 20,
    timestamps = env.timestamps, workgroups = kernel === "tiny" ? 1 : 264 } = cfg;
  const pipeline = env.pipelines[kernel];
  const groups = env.bindGroups[kernel];
  const submits = Math.ceil((steps + warm) / K);
  const total = submits * K;
  const useTs = timestamps && total * 2 <= 4096;
  const qs = useTs ? device.createQuerySet({ type: "timestamp", count: total * 2 }) : null;
  const ring = [];
  for (let r = 0; r < Q + 1; r++) {
    ring.push(device.createBuffer({ size: 256, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST }));
  }
  let encodeMs = 0;
  const submitStep = (s) => {
    const t0 = performance.now();
    const enc = device.createCommandEncoder();
    for (let k = 0; k < K; k++) {
      const i = s * K + k;
      const pass = enc.beginComputePass(useTs ? {
        timestampWrites: { querySet: qs, beginningOfPassWriteIndex: 2 * i, endOfPassWriteIndex: 2 * i + 1 },
      } : undefined);
      for (let d = 0; d < D; d++) {
        pass.setPipeline(pipeline);
        pass.setBindGroup(0, bg === "shared" ? groups[0] : groups[d]);
        pass.dispatchWorkgroups(workgroups);
      }
      pass.end();
      if (wait === "map") enc.copyBufferToBuffer(env.acc, 0, ring[s % ring.length], 4 * k, 4);
    }
    device.queue.submit([enc.finish()]);
    encodeMs += performance.now() - t0;
  };
  const readSubmit = async (s) => {
    const buf = ring[s % ring.length];
    await buf.mapAsync(GPUMapMode.READ, 0, 256);
    const v = new Uint32Array(buf.getMappedRange(0, 4 * K))[K - 1];
    buf.unmap();
    return v;
  };
  const warmSubmits = Math.ceil(warm / K);
  let t0 = 0;
  let next = 0;
  if (wait === "none") {  // throughput of the submit path alone: no reads until the end
    for (; next < submits; next++) {
      if (next === warmSubmits) { await device.queue.onSubmittedWorkDone(); t0 = performance.now(); encodeMs = 0; }
      submitStep(next);
    }
    await device.queue.onSubmittedWorkDone();
  } else {
    for (; next < Math.min(Q, submits); next++) submitStep(next);
    for (let s = 0; s < submits; s++) {
      if (s === warmSubmits) { t0 = performance.now(); encodeMs = 0; }
      if (wait === "map") await readSubmit(s);
      else await device.queue.onSubmittedWorkDone();  // wait "done": Q must be 1
      if (next < submits) submitStep(next++);
    }
  }
  const wallMs = performance.now() - t0;
  const measured = (submits - warmSubmits) * K;
  const out = { ...cfg, D, Q, K, kernel, bg, wait, steps: measured, ms_per_step: wallMs / measured,
    tok_per_s: 1000 * measured / wallMs, host_encode_submit_ms_per_step: encodeMs / measured };
  if (useTs) {
    const resolve = device.createBuffer({ size: total * 16, usage: GPUBufferUsage.QUERY_RESOLVE | GPUBufferUsage.COPY_SRC });
    const read = device.createBuffer({ size: total * 16, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST });
    const enc = device.createCommandEncoder();
    enc.resolveQuerySet(qs, 0, total * 2, resolve, 0);
    enc.copyBufferToBuffer(resolve, 0, read, 0, total * 16);
    device.queue.submit([enc.finish()]);
    await read.mapAsync(GPUMapMode.READ);
    const t = new BigInt64Array(read.getMappedRange());
    const busy = [];
    const gap = [];
    const first = warmSubmits * K;
    for (let i = first; i < total; i++) {
      busy.push(Number(t[2 * i + 1] - t[2 * i]) / 1000);
      if (i + 1 < total) gap.push(Number(t[2 * i + 2] - t[2 * i + 1]) / 1000);
    }
    const span = Number(t[2 * total - 1] - t[2 * first]) / 1000;
    out.gpu_busy_us_median = median(busy);
    out.gpu_gap_us_median = median(gap);
    out.gpu_gap_us_mean = gap.reduce((a, b) => a + b, 0) / Math.max(gap.length, 1);
    out.gpu_busy_fraction = busy.reduce((a, b) => a + b, 0) / span;
    read.unmap();
    read.destroy();
    resolve.destroy();
    qs.destroy();
  }
  for (const b of ring) b.destroy();
  return out;
}

// The whole suite; `plan` names experiment groups. Each result carries Date.now() stamps so the
// device script can match the browser's CPU samples (/proc) to experiments.
async function overheadSuite(plan, log = () => {}) {
  let adapter = null;
  for (let i = 0; i < 10 && !adapter; i++) {
    adapter = await navigator.gpu.requestAdapter({ powerPreference: "high-performance" });
    if (!adapter) await new Promise((r) => setTimeout(r, 1000));
  }
  if (!adapter) throw new Error("no WebGPU adapter");
  const timestamps = adapter.features.has("timestamp-query");
  const device = await adapter.requestDevice({ requiredFeatures: timestamps ? ["timestamp-query"] : [] });
  const env = await overheadSetup(device, 400);
  env.timestamps = timestamps;
  const results = [];
  const run = async (group, cfg) => {
    const start = Date.now();
    const r = await overheadRun(device, env, cfg);
    r.group = group;
    r.epoch_ms = [start, Date.now()];
    results.push(r);
    log(`${group} ${JSON.stringify(cfg)}: ${r.ms_per_step.toFixed(3)} ms/step, GPU busy ${r.gpu_busy_us_median} us`);
  };
  const small = !!plan.small;  // SwiftShader: a few steps only
  const N = small ? 12 : 400;
  const W = small ? 2 : 30;
  if (plan.latency) {
    await run("latency", { D: 1, Q: 1, wait: "map", steps: N, warm: W });
    await run("latency", { D: 1, Q: 1, wait: "done", steps: N, warm: W });
    await run("latency", { D: 1, Q: 1, wait: "none", steps: N, warm: W });
  }
  if (plan.dispatches) {
    for (const D of [1, 53, 185, 370]) await run("dispatches", { D, Q: 2, steps: N, warm: W });
    await run("dispatches", { D: 185, Q: 2, bg: "shared", steps: N, warm: W });
    for (const D of [53, 185, 370]) await run("dispatches", { D, Q: 2, wait: "none", steps: N, warm: W });
  }
  if (plan.depth) {
    for (const Q of [1, 2, 4, 8]) await run("depth", { D: 185, Q, steps: N, warm: W });
  }
  if (plan.batch) {
    for (const K of [2, 4, 8]) await run("batch", { D: 185, Q: 2, K, steps: N, warm: W });
    await run("batch", { D: 185, Q: 1, K: 8, steps: N, warm: W });
  }
  if (plan.work) {
    // Calibrate the work kernel to ~1.3 ms of GPU time per 185-dispatch step.
    let iter = small ? 16 : 400;
    await env.make("work", overheadWork(iter));
    if (!small && timestamps) {
      const probe = await overheadRun(device, env, { D: 185, Q: 1, kernel: "work", steps: 20, warm: 5 });
      if (probe.gpu_busy_us_median > 0) iter = Math.max(16, Math.min(200000, Math.round(iter * 1300 / probe.gpu_busy_us_median)));
      await env.make("work", overheadWork(iter));
    }
    for (const Q of [1, 2, 4]) await run("work", { D: 185, Q, kernel: "work", iter, steps: N, warm: W });
    await run("work", { D: 185, Q: 2, K: 4, kernel: "work", iter, steps: N, warm: W });
    await run("work", { D: 185, Q: 2, kernel: "work", iter, wait: "none", steps: N, warm: W });
  }
  device.destroy();
  return { timestamps, where: typeof window === "undefined" ? "worker" : "page", results };
}

if (typeof window === "undefined" && typeof importScripts === "function") {
  self.onmessage = async (event) => {
    try {
      postMessage({ done: await overheadSuite(event.data, (m) => postMessage({ log: m })) });
    } catch (err) {
      postMessage({ error: String((err && err.stack) || err) });
    }
  };
}
