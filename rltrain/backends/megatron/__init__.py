"""The megatron-core training backend (TP x PP x DP), usable on CPU over gloo.

Import `rltrain.backends.megatron.engine.MegatronEngine`; this package import itself pulls in
nothing from megatron, so a run with another backend never imports it.
"""
