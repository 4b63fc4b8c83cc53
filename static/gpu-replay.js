// Replays a recorded WebGPU command list in one call from Python (bitnet_web/gpu/browser.py).
//
// Each WebGPU call made from Pyodide crosses its JS FFI (4-6 us per dispatch for setPipeline +
// setBindGroup + dispatchWorkgroups from Python, 0.4-0.7 us from JS: shared/browser-notes.md).
// A decode step issues the same commands token after token, so the Python recorder keeps each
// distinct command list as a JS array ("program", built once) and encodes a step with ONE call to
// `encode` here. Loaded by a plain <script> / importScripts (no eval: the app's
// Content-Security-Policy has no 'unsafe-eval'); Python finds it as `js.bitnetGpuReplay`.
//
// A program is a flat array of 6-slot commands:
//   [0, pipeline, bindGroup, x, y, z]                       compute dispatch (bind group 0)
//   [1, srcBuffer, srcOffset, dstBuffer, dstOffset, size]   copyBufferToBuffer (ends the pass)
"use strict";
self.bitnetGpuReplay = Object.freeze({
  version: 1,
  DISPATCH: 0,
  COPY: 1,
  SLOTS: 6,

  // Encode `program` into a fresh command encoder; return the finished GPUCommandBuffer.
  // Consecutive dispatches share one compute pass, as the Python recorder's direct path does.
  encode(device, program) {
    const encoder = device.createCommandEncoder();
    let pass = null;
    for (let i = 0; i < program.length; i += 6) {
      if (program[i] === 0) {
        if (pass === null) pass = encoder.beginComputePass();
        pass.setPipeline(program[i + 1]);
        pass.setBindGroup(0, program[i + 2]);
        pass.dispatchWorkgroups(program[i + 3], program[i + 4], program[i + 5]);
      } else if (program[i] === 1) {
        if (pass !== null) { pass.end(); pass = null; }
        encoder.copyBufferToBuffer(program[i + 1], program[i + 2], program[i + 3], program[i + 4], program[i + 5]);
      } else {
        throw new Error(`bitnetGpuReplay: unknown command ${program[i]} at slot ${i}`);
      }
    }
    if (pass !== null) pass.end();
    return encoder.finish();
  },

  // queue.submit([commandBuffer]) without building the array on the Python side.
  submit(queue, commandBuffer) {
    queue.submit([commandBuffer]);
  },
});
