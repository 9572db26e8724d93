"""The front's defaults (light: the CLI imports this without aiohttp)."""

DEFAULT_HOST = "127.0.0.1"   # loopback: a sandbox's own network namespace cannot reach it
DEFAULT_PORT = 49983         # envd's port in E2B
KEY_ENV = "CORRAL_E2B_API_KEY"
