"""Calls on big host buffers that release the GIL (ctypes): CRC32C and fresh,
populated host memory. Work beside the training thread goes through these."""
