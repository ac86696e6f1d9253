"""deepspeed.compression: the module helpers scripts import from it
(helper.recursive_getattr, recursive_setattr). DeepSpeed's compression
training itself (compress.init_compression, redundancy_clean: quantization,
pruning, layer reduction) is not tidal's: importing
tidal.deepspeed.compression.compress raises an error naming it
(refused.py)."""
