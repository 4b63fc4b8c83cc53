// The engine worker's bootstrap: start Pyodide with numpy, unpack the bitnet_web package, and hand
// every message to bitnet_web.ui.worker (Python). All app logic is in Python; this file only boots.
"use strict";
const root = new URL("./", self.location.href);
const early = [];
self.onmessage = (event) => early.push(event); // replayed by Python once it is ready

const fail = (err) =>
  postMessage(JSON.stringify({ event: "fatal", kind: "worker_start", message: String((err && err.stack) || err) }));

(async () => {
  importScripts(new URL("pyodide/pyodide.js", root).href);
  const pyodide = await loadPyodide({ indexURL: new URL("pyodide/", root).href });
  await pyodide.loadPackage("numpy", { messageCallback: () => {} });
  const response = await fetch(new URL("bitnet_web.zip", root));
  if (!response.ok) throw new Error(`bitnet_web.zip: HTTP ${response.status}`);
  pyodide.unpackArchive(await response.arrayBuffer(), "zip", { extractDir: "/home/pyodide" });
  pyodide.runPython("import sys; sys.path.insert(0, '/home/pyodide')");
  pyodide.pyimport("bitnet_web.ui.worker").start(root.href, early);
})().catch(fail);
