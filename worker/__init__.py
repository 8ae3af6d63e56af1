"""The engine on one device. Never imports ray or HTTP code (DESIGN §3)."""
