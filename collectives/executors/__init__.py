"""Executors interpret plans (see collectives.plan) on one kind of memory."""
