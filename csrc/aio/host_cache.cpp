// A CPU allocator that keeps recently freed large buffers for reuse, within a byte budget.
//
// [Note: host buffer cache]
// With CPU or NVMe offload zerotune has glibc serve buffers of 1 MiB and more with mmap, so
// freed memory goes back to the system and RSS stays what the plan says (memory/host.py).
// The price is paid again every step: each fresh buffer is page-faulted and zeroed by the
// kernel on first touch. On a CPU device that is most of a step's tensors: every weight
// gradient, the larger activations and backward's temporaries (gigabytes a step for
// gpt2-medium; benchmarks/RESULTS.md).
//
// Installed as c10's CPU allocator, this one serves allocations of at least `min_bytes`
// itself: page-aligned anonymous mappings, kept when freed while the kept bytes stay within
// `budget`, the oldest given back to the system first (LRU). A request is served from a kept
// buffer of the same page-rounded size, the most recently freed one. A step asks for the
// same sizes in the same order each time (a block's weight gradients, the next block's
// after them), so a budget of about one block's worth turns most of the churn into reuse,
// at no higher peak RSS. Smaller requests go to the allocator found at install
// time (glibc's heap, which reuses them anyway). Freed buffers keep their old bytes, as
// malloc's do: torch.empty promises nothing about them.
//
// The DataPtr's context is its data pointer (a map gives the size), so raw_allocate works;
// a raw pointer this allocator did not make goes to the previous allocator's deleter.
// Unmapping happens outside the lock. The lock is held across fork (pthread_atfork), so a
// child (a DataLoader worker) never inherits it locked. Uninstalling restores the previous
// allocator; buffers still alive keep this deleter, which stays valid (the module is never
// unloaded).

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <list>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace zerotune_aio {

namespace {

constexpr uint8_t kPriority = 50;  // above c10's default CPU allocator (0)

struct Kept {
  void* ptr;
  size_t bytes;
};

class HostCache final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override;
  c10::DeleterFnPtr raw_deleter() const override { return &HostCache::free_ptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  static void free_ptr(void* ptr);

  std::mutex mu;
  c10::Allocator* previous = nullptr;
  bool installed = false;
  size_t budget = 0;
  std::atomic<size_t> min_bytes{1 << 20};  // read without the lock
  // Live buffers made here: pointer -> mapped bytes.
  std::unordered_map<void*, size_t> live;
  size_t live_bytes = 0;
  // Kept buffers, most recently freed first, and an index by size into that list.
  std::list<Kept> kept;
  std::unordered_map<size_t, std::vector<std::list<Kept>::iterator>> kept_by_size;
  size_t kept_bytes = 0;
  size_t peak_kept = 0;
  int64_t hits = 0;
  int64_t misses = 0;

  // The oldest kept buffers beyond `limit` bytes, taken out (the caller unmaps them).
  std::vector<Kept> trim_to(size_t limit) {
    std::vector<Kept> out;
    while (kept_bytes > limit) {
      Kept k = kept.back();
      auto& same = kept_by_size[k.bytes];
      for (auto it = same.begin(); it != same.end(); ++it) {
        if ((*it)->ptr == k.ptr) {
          same.erase(it);
          break;
        }
      }
      kept.pop_back();
      kept_bytes -= k.bytes;
      out.push_back(k);
    }
    return out;
  }
};

HostCache& cache() {
  static auto* c = new HostCache();  // never destroyed: buffers may outlive everything
  return *c;
}

void unmap_all(const std::vector<Kept>& bufs) {
  for (const Kept& k : bufs) munmap(k.ptr, k.bytes);
}

size_t page_round(size_t n) {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return (n + page - 1) / page * page;
}

c10::DataPtr HostCache::allocate(size_t n) {
  if (n < min_bytes) return previous->allocate(n);
  const size_t bytes = page_round(n);
  void* ptr = nullptr;
  {
    std::lock_guard<std::mutex> lk(mu);
    auto it = kept_by_size.find(bytes);
    if (it != kept_by_size.end() && !it->second.empty()) {
      auto entry = it->second.back();
      it->second.pop_back();
      ptr = entry->ptr;
      kept.erase(entry);
      kept_bytes -= bytes;
      ++hits;
    } else {
      ++misses;
    }
  }
  if (ptr == nullptr) {
    ptr = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (ptr == MAP_FAILED) {
      TORCH_CHECK_WITH(OutOfMemoryError, false, "zerotune host cache: mmap of ", bytes,
                       " bytes failed: ", std::strerror(errno));
    }
  }
  size_t total;
  {
    std::lock_guard<std::mutex> lk(mu);
    live.emplace(ptr, bytes);
    live_bytes += bytes;
    total = live_bytes;
  }
  if (c10::memoryProfilingEnabled()) {
    c10::reportMemoryUsageToProfiler(ptr, static_cast<int64_t>(bytes), total, total,
                                     c10::Device(c10::DeviceType::CPU));
  }
  return {ptr, ptr, &HostCache::free_ptr, c10::Device(c10::DeviceType::CPU)};
}

void HostCache::free_ptr(void* ptr) {
  if (ptr == nullptr) return;
  HostCache& c = cache();
  std::vector<Kept> drop;
  size_t bytes = 0;
  size_t total = 0;
  c10::DeleterFnPtr theirs = nullptr;
  {
    std::lock_guard<std::mutex> lk(c.mu);
    auto it = c.live.find(ptr);
    if (it == c.live.end()) {
      // raw_allocate below min_bytes went to the previous allocator: so does its free.
      theirs = c.previous != nullptr ? c.previous->raw_deleter() : nullptr;
      TORCH_INTERNAL_ASSERT(theirs != nullptr, "zerotune host cache: unknown pointer freed");
    } else {
      bytes = it->second;
      c.live.erase(it);
      c.live_bytes -= bytes;
      total = c.live_bytes;
      if (bytes <= c.budget) {
        c.kept.push_front(Kept{ptr, bytes});
        c.kept_by_size[bytes].push_back(c.kept.begin());
        c.kept_bytes += bytes;
        drop = c.trim_to(c.budget);  // never ptr itself: it is the newest
        if (c.kept_bytes > c.peak_kept) c.peak_kept = c.kept_bytes;
      } else {
        drop.push_back(Kept{ptr, bytes});
      }
    }
  }
  if (theirs != nullptr) {
    theirs(ptr);
    return;
  }
  if (c10::memoryProfilingEnabled()) {
    c10::reportMemoryUsageToProfiler(ptr, -static_cast<int64_t>(bytes), total, total,
                                     c10::Device(c10::DeviceType::CPU));
  }
  unmap_all(drop);
}

void lock_for_fork() { cache().mu.lock(); }
void unlock_after_fork() { cache().mu.unlock(); }

}  // namespace

// Install (once) and set the budget; a smaller budget gives back the oldest kept buffers.
// Returns false when another CPU allocator of higher priority is in place (nothing changes).
bool host_cache_enable(int64_t budget, int64_t min_bytes) {
  TORCH_CHECK(budget >= 0 && min_bytes >= 4096, "host cache: budget must be >= 0 and ",
              "min_bytes >= 4096");
  HostCache& c = cache();
  std::vector<Kept> drop;
  {
    std::lock_guard<std::mutex> lk(c.mu);
    if (!c.installed) {
      c10::Allocator* current = c10::GetCPUAllocator();
      c.previous = current;  // before any allocate() can run
      c10::SetCPUAllocator(&c, kPriority);
      if (c10::GetCPUAllocator() != &c) return false;
      c.installed = true;
      c.peak_kept = c.kept_bytes;  // the counts start afresh with each installation
      c.hits = 0;
      c.misses = 0;
      static bool registered = false;
      if (!registered) {
        pthread_atfork(&lock_for_fork, &unlock_after_fork, &unlock_after_fork);
        registered = true;
      }
    }
    c.budget = static_cast<size_t>(budget);
    c.min_bytes.store(static_cast<size_t>(min_bytes));
    drop = c.trim_to(c.budget);
  }
  unmap_all(drop);
  return true;
}

// Give back every kept buffer and restore the previous allocator (buffers still alive are
// freed by this allocator's deleter later).
void host_cache_disable() {
  HostCache& c = cache();
  std::vector<Kept> drop;
  {
    std::lock_guard<std::mutex> lk(c.mu);
    if (c.installed && c10::GetCPUAllocator() == &c) {
      c10::SetCPUAllocator(c.previous, kPriority);
      c.installed = false;
    }
    c.budget = 0;
    drop = c.trim_to(0);
  }
  unmap_all(drop);
}

// (installed, budget, kept bytes, peak kept bytes, live bytes, hits, misses); the peak and
// the counts start afresh with each installation.
std::tuple<bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t> host_cache_stats() {
  HostCache& c = cache();
  std::lock_guard<std::mutex> lk(c.mu);
  return {c.installed, static_cast<int64_t>(c.budget), static_cast<int64_t>(c.kept_bytes),
          static_cast<int64_t>(c.peak_kept), static_cast<int64_t>(c.live_bytes), c.hits,
          c.misses};
}

}  // namespace zerotune_aio
