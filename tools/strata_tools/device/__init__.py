"""The GPU-machine tools behind the commands in tools/device/: parity, adaptation traces,
kernel and op profiles, PTX and SASS checks."""
