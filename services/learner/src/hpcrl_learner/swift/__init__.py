"""The `swift` backend's parts: pure batch conversion, the driver, the Megatron worker.

``convert`` needs torch only (ms-swift is imported inside the functions that call it); the
other modules need the ms-swift environment (``deploy/local/install-swift.sh``).
"""
