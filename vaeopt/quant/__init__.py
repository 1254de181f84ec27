"""Quantization of the decoder: which layer runs in which format, and the fidelity gate that decides.

  numerics.py     the formats: e4m3 per output channel / per tensor and int8 per output channel (the quantizers are
                  vaeopt/kernels/fp8_quant.py's, shared with the 8-bit conv kernels' packed weights), and their
                  emulation (values rounded through e4m3 and back)
  plan.py         the per-layer plan of the fp8 stage: each decoder conv / linear as "gemm" (e4m3 GEMM), "storage"
                  (e4m3 weights, dequantized per call) or "kept" (the compute dtype); conv_in / conv_out kept
  sensitivity.py  per-layer sensitivity measured by emulated decodes, the stored measurements of the bundled decoders
                  (configs/fp8_sensitivity.json) and the policy that picks the layers to keep
  gate.py         the probe against the fp32 decode and the retries that keep the most sensitive layers

The module wrappers that run the plan are vaeopt/stages/fp8.py's (weight storage, fp8 GEMMs); this package imports
no stage, so stages depend on it and never the reverse.
"""
