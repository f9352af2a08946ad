from torchvision._standin import module_getattr as __getattr__  # noqa: F401
