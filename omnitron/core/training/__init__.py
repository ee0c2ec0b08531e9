"""The training entry points: arguments -> Settings, launch, the loop (see ``loop.train``)."""
