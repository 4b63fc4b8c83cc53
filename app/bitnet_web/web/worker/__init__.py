"""The engine worker (Pyodide in a Web Worker): owns the Engine, the IndexedDB model store and the downloads."""
