"""The partitioning service the ZeRO stages share.

* :mod:`.flat`       stages 1-2's layout: one flat buffer per param group, rank r owning a slice
* :mod:`.gradients`  unscale, norm, overflow check and clipping of the gradients a stage reduced
* :mod:`.elementwise` which optimizers step flat slices exactly (stages 1-3)
* :mod:`.offload`    optimizer and parameter state in an offload device, through the storage
  contract (:class:`dsplug.contracts.OffloadDevice`): opening the devices, the CPU optimizer,
  state placed in byte-addressable storage, the swapper for devices that need swap buffers

No module here imports a stage; the stages import these.
"""
