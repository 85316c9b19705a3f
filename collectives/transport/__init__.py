"""Transports: how a rank reaches its peers' buffers."""
