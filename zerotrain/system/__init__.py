"""The machine underneath: files written so a crash leaves the old or the whole new one, and whether
a process still runs. The bottom layer: imports nothing of zerotrain, so every layer can use it."""
