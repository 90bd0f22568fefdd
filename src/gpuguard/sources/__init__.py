"""Event sources: translate outside signals into "these reconcilers may have work".

A source never acts; it only calls the mark function it was given.
"""
