def unavailable(*args, **kwargs):
    raise RuntimeError("torchvision stand-in: image processing is not available in this test environment")


def module_getattr(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return unavailable
