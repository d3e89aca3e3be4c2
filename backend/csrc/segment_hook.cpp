// Close before free, torch's side: a trace tracker on the CUDA caching allocator that, for a
// segment about to be returned to the driver, has smddpd unmap it first (free_channel.cpp).
//
// What torch does (c10/cuda/CUDACachingAllocator.cpp; read at pytorch/pytorch 001074d2, the
// same in the generic allocator of later versions): DeviceCachingAllocator::release_block
// calls record_trace(SEGMENT_FREE, block->ptr, block->size, ...) and only then
// cudaFree(block->ptr), so the segment is still allocated when the tracker runs.
// release_block is reached from emptyCache() (under the per-device recursive `mutex`, after
// synchronize_and_free_events), from malloc's out-of-memory retry (release_available_cached_
// blocks / release_cached_blocks, under the same mutex), and from
// garbage_collect_cached_blocks (no synchronisation at all). record_trace calls every
// attached tracker whenever any is attached (`if (!record_history && trace_trackers_.empty())
// return;`), so no memory history needs recording. SEGMENT_UNMAP (expandable segments) is
// traced after cuMemUnmap, but such memory cannot be exported by CUDA IPC and smddp refuses
// it, so it is ignored here. ProcessGroupNCCL does the same for its buffer registration:
// cacheAllocatorDeregisterHook ("deregister before SEGMENT_FREE") calls ncclCommDeregister
// synchronously from this callback. torch's header (torch 2.13's CUDACachingAllocator.h
// lines 243-249: "Attached AllocatorTraceTracker callbacks will be called while the
// per-device allocator lock is held ... it is unsafe to try to acquire the GIL in this
// callback"): hence no Python here. TraceEntry and AllocatorTraceTracker are declared in
// c10/core/CachingDeviceAllocator.h (lines 117-206 there); addr_ and size_ are the segment's.
// (Character offsets, not line numbers, are what the stored pytorch source gave: v2.11.0
// itself was not available to read; the installed 2.13 headers agree with the above.)
//
// Trackers attach to the device allocators that exist, so install only after torch's CUDA
// lazy init (backend/cuda_free_hook.py calls torch.cuda.init() first). There is no detach:
// the tracker stays for the life of the process, and after smddp_fc_close it returns at once.
#include <c10/cuda/CUDACachingAllocator.h>

#include <mutex>

#include "free_channel.h"

namespace {

std::once_flag installed;

void on_trace(const c10::cuda::CUDACachingAllocator::TraceEntry& te) {
  if (te.action_ == c10::cuda::CUDACachingAllocator::TraceEntry::SEGMENT_FREE) {
    smddp_fc_segment_free(uint64_t(te.addr_), uint64_t(te.size_));
  }
}

}  // namespace

// Attaches the tracker once per process. Returns 0, or -1 if torch refused.
extern "C" int smddp_free_hook_install(void) {
  try {
    std::call_once(installed, [] {
      c10::cuda::CUDACachingAllocator::attachAllocatorTraceTracker(&on_trace);
    });
    return 0;
  } catch (...) {
    return -1;
  }
}
