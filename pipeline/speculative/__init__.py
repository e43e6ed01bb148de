"""Speculative decoding: drafters (prompt lookup, a draft model), the verify pass and
its loop on the device, the round rule that weighs a pass against plain steps."""
