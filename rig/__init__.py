"""The simulated-mobile test rig: emulated links, simulated phones, split vs all-cloud vs all-edge.

``autoglm-rig run SCENARIO.yaml`` and ``autoglm-rig demo`` (see docs/rig.md). Modules: ``link`` (the TCP
link emulator), ``profiles`` (link profiles), and the rig itself (scenario, phones, baselines, report).
"""
