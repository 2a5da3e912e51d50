"""The skyrl-train 0.3.1 leg: these tests run in the second environment (`.venv-skyrl-train`, `make test`)."""
