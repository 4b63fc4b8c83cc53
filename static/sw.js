// Service worker: keeps the app usable offline after the first visit.
// It precaches the whole site as built (page, PyScript, Pyodide + wheels, bitnet_web, the bundled
// model); build.py writes the file list and a version hash below. Big downloaded models are not
// here: they live in IndexedDB. Range requests (download resume) and other sites go to the network.
"use strict";
const PRECACHE = __PRECACHE_MANIFEST__;
const CACHE = "bitnet-web-" + PRECACHE.version;
const scope = new URL(self.registration.scope);
const files = new Set(PRECACHE.files);

self.addEventListener("install", (event) => {
  event.waitUntil((async () => {
    const cache = await caches.open(CACHE);
    await cache.addAll(PRECACHE.files.map((f) => new Request(new URL(f, scope), { cache: "reload" })));
    await self.skipWaiting();
  })());
});

self.addEventListener("activate", (event) => {
  event.waitUntil((async () => {
    for (const name of await caches.keys()) {
      if (name.startsWith("bitnet-web-") && name !== CACHE) await caches.delete(name);
    }
    await self.clients.claim();
  })());
});

self.addEventListener("fetch", (event) => {
  const request = event.request;
  if (request.method !== "GET" || request.headers.has("range")) return;
  const url = new URL(request.url);
  if (url.origin !== scope.origin || !url.pathname.startsWith(scope.pathname)) return;
  let path = url.pathname.slice(scope.pathname.length);
  if (path === "" || path.endsWith("/")) path += "index.html";
  if (!files.has(path)) return;
  event.respondWith((async () => {
    const cached = await caches.match(new URL(path, scope).href, { cacheName: CACHE });
    return cached || fetch(request);
  })());
});
