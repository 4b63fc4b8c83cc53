"""Pure-Python pieces both sides of the web app use: typed messages, progress, settings, prompts, failures."""
