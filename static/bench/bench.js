// What every benchmark page shares: the status line, the model to run, Pyodide with numpy and the
// bitnet_web package, and the hand-over of the result (shown, and in window.benchResult for the
// drivers in tools/). A page calls benchPage(async (params) => JSON text of its report).
"use strict";

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
  const pyodide = await loadPyodide({ indexURL: new URL("../pyodide/", location.href).href });
  await pyodide.loadPackage("numpy", { messageCallback: () => {} });
  if (withPackage) {
    const zip = await fetch("../bitnet_web.zip");
    pyodide.unpackArchive(await zip.arrayBuffer(), "zip", { extractDir: "/home/pyodide" });
    pyodide.globals.set("say", say);
  }
  return pyodide;
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
