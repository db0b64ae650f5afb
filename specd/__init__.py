"""specd: speculative decoding served as three gRPC services (draft, verifier, gateway).

This package is the shared core: the pure math (`sampling`, `rejection`), the model
runtime (`runtime`), wire packing of distributions (`wire`), settings (`config`) and the
command line (`cli`). Generated protobuf code lives in `specd.v1`.
"""
