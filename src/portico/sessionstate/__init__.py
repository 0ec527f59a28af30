"""Where `/v1/session` numbered-stream state lives so any replica can resume it."""
