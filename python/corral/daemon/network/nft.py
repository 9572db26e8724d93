"""nftables through libnftables (in process: a command costs tens of microseconds, where
spawning nft(8) costs milliseconds)."""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

from corral.errors import Unsupported


class NftError(RuntimeError):
    """A command libnftables refused; the message is its error output."""


class Nft:
    """One libnftables context, serialised (a context is not thread-safe)."""

    def __init__(self) -> None:
        name = ctypes.util.find_library("nftables") or "libnftables.so.1"
        try:
            lib = ctypes.CDLL(name, use_errno=True)
        except OSError as e:
            raise Unsupported(f"networked sandboxes need libnftables (Debian: nftables): {e}",
                              details={"library": name}) from None
        lib.nft_ctx_new.restype = ctypes.c_void_p
        lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
        lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_output_buffer.restype = ctypes.c_char_p
        lib.nft_ctx_get_output_buffer.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
        lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
        lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
        self._lib = lib
        self._ctx = lib.nft_ctx_new(0)
        if not self._ctx:
            raise Unsupported("libnftables: cannot make a context")
        lib.nft_ctx_buffer_output(self._ctx)
        lib.nft_ctx_buffer_error(self._ctx)
        self._lock = threading.Lock()

    def run(self, cmd: str, json_out: bool = False) -> str:
        """Run ``cmd`` (one or more commands, one transaction); its output."""
        with self._lock:
            if not self._ctx:
                raise NftError("closed")
            # NFT_CTX_OUTPUT_JSON (1 << 4) for listings the caller parses.
            self._lib.nft_ctx_output_set_flags(self._ctx, (1 << 4) if json_out else 0)
            rc = self._lib.nft_run_cmd_from_buffer(self._ctx, cmd.encode())
            out = self._lib.nft_ctx_get_output_buffer(self._ctx) or b""
            err = self._lib.nft_ctx_get_error_buffer(self._ctx) or b""
        if rc != 0:
            raise NftError(err.decode(errors="replace").strip() or f"nft: rc {rc}")
        return out.decode(errors="replace")

    def close(self) -> None:
        with self._lock:
            if self._ctx:
                self._lib.nft_ctx_free(self._ctx)
                self._ctx = None
