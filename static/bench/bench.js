// What every benchmark page shares: the status line, the model to run, Pyodide with numpy and the
// bitnet_web package, and the hand-over of the result (shown, and in window.benchResult for the
// drivers in tools/). A page calls benchPage(async (params) => JSON text of its report), or
// benchPythonPage when its report is a Python program's.
"use strict";

// The status line and the report, after the page's description.
for (const id of ["status", "result"]) {
  const pre = document.createElement("pre");
  pre.id = id;
  document.body.append(pre);
}

function say(text) {
  document.getElementById("status").textContent = text;
  console.log(text);
}

// The `model` query parameter, else the bundled model of models.json, as an absolute URL.
async function benchModelUrl(params) {
  const models = await (await fetch("../models/models.json")).json();
  const bundled = models.models.find((m) => m.bundled) || models.models[0];
  return new URL(params.get("model") || ("../" + bundled.url), location.href).href;
}

// Pyodide with numpy; with `withPackage`, bitnet_web unpacked to /home/pyodide and `say` in its globals.
async function benchPyodide(withPackage = true) {
  say("loading Pyodide...");
  const indexURL = new URL("../pyodide/", location.href).href;
  const { loadPyodide } = await import(indexURL + "pyodide.mjs");
  const pyodide = await loadPyodide({ indexURL });
  await pyodide.loadPackage("numpy", { messageCallback: () => {} });
  if (withPackage) {
    const zip = await fetch("../bitnet_web.zip");
    pyodide.unpackArchive(await zip.arrayBuffer(), "zip", { extractDir: "/home/pyodide" });
    pyodide.runPython('import sys; sys.path.insert(0, "/home/pyodide")');
    pyodide.globals.set("say", say);
  }
  return pyodide;
}

// A page whose report is Python's: `code` runs with bitnet_web importable, `say`, MODEL_URL
// (benchModelUrl) and the globals `globals(params)` names set; its last expression (JSON text) is the report.
function benchPythonPage(globals, code) {
  benchPage(async (params) => {
    const modelUrl = await benchModelUrl(params);
    const pyodide = await benchPyodide();
    pyodide.globals.set("MODEL_URL", modelUrl);
    for (const [name, value] of Object.entries(globals(params))) pyodide.globals.set(name, value);
    return await pyodide.runPythonAsync(code);
  });
}

function benchPage(run) {
  (async () => {
    const report = await run(new URLSearchParams(location.search));
    document.getElementById("result").textContent = report;
    window.benchResult = report;
    say("done");
  })().catch((err) => {
    say("failed: " + ((err && err.stack) || err));
    window.benchResult = JSON.stringify({ error: String(err) });
  });
}
