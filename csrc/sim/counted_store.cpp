// The store every simccl communicator talks through (declared in comm.h): forwards each operation to the group's
// store and counts it, so a test can bound the store traffic of sim's checks where it really happens (a polling
// loop anywhere in csrc/sim is counted, whether or not its author thought of counting it).
#include "comm.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <atomic>

namespace sim {
namespace {

std::atomic<int64_t> g_store_ops{0};

class CountedStore final : public c10d::Store {
 public:
  explicit CountedStore(c10::intrusive_ptr<c10d::Store> inner) : inner_(std::move(inner)) {}
  c10::intrusive_ptr<c10d::Store> inner() const { return inner_; }

  c10::intrusive_ptr<c10d::Store> clone() override { return c10::make_intrusive<CountedStore>(inner_->clone()); }
  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    tick();
    inner_->set(key, value);
  }
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override {
    tick();
    return inner_->compareSet(key, expected, desired);
  }
  std::vector<uint8_t> get(const std::string& key) override {
    tick();
    return inner_->get(key);
  }
  int64_t add(const std::string& key, int64_t value) override {
    tick();
    return inner_->add(key, value);
  }
  bool deleteKey(const std::string& key) override {
    tick();
    return inner_->deleteKey(key);
  }
  bool check(const std::vector<std::string>& keys) override {
    tick();
    return inner_->check(keys);
  }
  int64_t getNumKeys() override {
    tick();
    return inner_->getNumKeys();
  }
  void wait(const std::vector<std::string>& keys) override {
    tick();
    inner_->wait(keys);
  }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    tick();
    inner_->wait(keys, timeout);
  }
  const std::chrono::milliseconds& getTimeout() const noexcept override { return inner_->getTimeout(); }
  void setTimeout(const std::chrono::milliseconds& timeout) override { inner_->setTimeout(timeout); }

 private:
  static void tick() { g_store_ops.fetch_add(1, std::memory_order_relaxed); }
  c10::intrusive_ptr<c10d::Store> inner_;
};

}  // namespace

c10::intrusive_ptr<c10d::Store> counted_store(c10::intrusive_ptr<c10d::Store> store) {
  if (dynamic_cast<CountedStore*>(store.get())) return store;
  return c10::make_intrusive<CountedStore>(std::move(store));
}

c10::intrusive_ptr<c10d::Store> job_store(c10::intrusive_ptr<c10d::Store> store) {
  for (;;) {
    if (auto* counted = dynamic_cast<CountedStore*>(store.get())) {
      store = counted->inner();
    } else if (auto* prefix = dynamic_cast<c10d::PrefixStore*>(store.get())) {
      store = prefix->getUnderlyingStore();
    } else {
      return counted_store(std::move(store));
    }
  }
}

int64_t store_ops() { return g_store_ops.load(); }

}  // namespace sim
