"""Layer 1, communication: the process group set up from any launcher's environment, every
collective the engine issues (counted, so a step's bytes can be checked against ZeRO's 2Ψ/3Ψ),
and the group's teardown at exit. Imports only `zerotrain.config`."""
