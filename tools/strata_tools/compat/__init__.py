"""The compatibility run (tools/compat/run): the pytest plugin that runs the pin's server tests
offline, their report, and the side-by-side request check."""
