// Watchdog: an armed phase that outlives its limit is reported once, naming the
// phase; a phase disarmed in time, or re-armed before its limit, is not.
#include "parallel/watchdog.h"

#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"

namespace smat {
namespace {

struct Reports {
  absl::Mutex mu;
  std::string last;
  int count = 0;
  void Add(const std::string& m) {
    absl::MutexLock lock(&mu);
    last = m;
    ++count;
  }
  int n() {
    absl::MutexLock lock(&mu);
    return count;
  }
};

TEST(Watchdog, ReportsAPhaseThatOutlivesItsLimitOnce) {
  Reports r;
  Watchdog dog([&](const std::string& m) { r.Add(m); });
  dog.Arm("step 7", absl::Milliseconds(100));
  std::this_thread::sleep_for(std::chrono::milliseconds(600));
  EXPECT_EQ(r.n(), 1);
  EXPECT_EQ(dog.expirations(), 1);
  absl::MutexLock lock(&r.mu);
  EXPECT_NE(r.last.find("step 7"), std::string::npos) << r.last;
  EXPECT_NE(r.last.find("elapsed"), std::string::npos) << r.last;
}

TEST(Watchdog, DisarmedOrRearmedInTimeIsQuiet) {
  Reports r;
  Watchdog dog([&](const std::string& m) { r.Add(m); });
  for (int i = 0; i < 5; ++i) {  // each phase finishes well inside its 300 ms
    dog.Arm("step", absl::Milliseconds(300));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  dog.Disarm();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_EQ(r.n(), 0);
}

}  // namespace
}  // namespace smat
