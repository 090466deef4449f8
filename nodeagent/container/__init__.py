"""Container mode: the guide's `docker run` line rendered, the engine shell, lifecycle decisions, components
launched and adopted inside the container, and the `ContainerMode` layer that keeps the container.
"""
