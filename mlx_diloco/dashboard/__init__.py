"""The dashboard: a web page of a run, live or finished, read from its folder (server.py serves
static/: the page, its script, and the vendored uPlot that draws its charts)."""
