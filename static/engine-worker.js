// The engine worker's bootstrap: start Pyodide with numpy, unpack the bitnet_web package, and hand
// every message to bitnet_web.web.worker.main (Python). All app logic is in Python; this file only boots.
//
// Content-Security-Policy: a worker gets its policy from its own response headers (build.py's server
// sends one without 'unsafe-eval': Pyodide needs only 'wasm-unsafe-eval'). Violations are kept in
// self.cspViolations and reported to the page as log lines, so a blocked request is never silent.
"use strict";
const root = new URL("./", self.location.href);
const early = [];
self.onmessage = (event) => early.push(event); // replayed by Python once it is ready

self.cspViolations = [];
self.addEventListener("securitypolicyviolation", (e) => {
  const what = `${e.effectiveDirective} blocked ${e.blockedURI || "(inline)"}`;
  self.cspViolations.push(what);
  postMessage(JSON.stringify({ event: "log", message: `Content-Security-Policy: ${what}` }));
});

const fail = (err) =>
  postMessage(JSON.stringify({ event: "fatal", kind: "worker_start", message: String((err && err.stack) || err) }));

(async () => {
  importScripts(new URL("pyodide/pyodide.js", root).href);
  // bitnetGpuReplay: encodes a recorded GPU step in one call from Python (gpu/browser.py)
  importScripts(new URL("gpu-replay.js", root).href);
  const pyodide = await loadPyodide({ indexURL: new URL("pyodide/", root).href });
  // The worker's own interpreter, for DevTools and the browser tests (a worker's globals are not
  // reachable from the page or from other sites).
  self.pyodide = pyodide;
  await pyodide.loadPackage("numpy", { messageCallback: () => {} });
  const response = await fetch(new URL("bitnet_web.zip", root));
  if (!response.ok) throw new Error(`bitnet_web.zip: HTTP ${response.status}`);
  pyodide.unpackArchive(await response.arrayBuffer(), "zip", { extractDir: "/home/pyodide" });
  pyodide.runPython("import sys; sys.path.insert(0, '/home/pyodide')");
  pyodide.pyimport("bitnet_web.web.worker.main").start(root.href, early);
})().catch(fail);
