// Lets ThreadSanitizer see absl::Mutex and absl::CondVar when abseil itself
// was built without TSan, as Debian 12's is. Loaded with LD_PRELOAD into a
// TSan build (.ci/sanitize tsan), it defines the public lock and wait entry
// points of abseil 20220623, so that they win symbol lookup over
// libabsl_synchronization for every caller: our code, gRPC and abseil's own
// cross-function calls. Each one tells TSan what it does with the
// annotations abseil would emit had it been built with TSan, around a call to
// the real function found with dlsym(RTLD_NEXT).
//
// Between a pre and a post annotation TSan ignores memory accesses, exactly
// as abseil's own annotations make it: that covers Conditions that abseil
// evaluates on behalf of other threads while it releases a lock.
//
// ~Mutex is left alone: gRPC destroys its objects on whichever thread drops
// the last reference, ordered by atomics TSan cannot see, so annotating the
// destruction reports races that are not there. (TSan forgets a mutex when
// its memory is freed.) The WithTimeout forms are left alone too: abseil turns each into a deadline and
// calls its WithDeadline form through the PLT, which lands here (annotating
// both would unlock twice).
//
// Built only for that stage; the names are those of Debian's abseil (inline
// namespace debian3), and a missing one stops the run with its name.
#include <dlfcn.h>
#include <sanitizer/tsan_interface.h>

#include <cstdio>
#include <cstdlib>

#include "absl/synchronization/mutex.h"

// Weak: the preload reaches every process the test starts, llvm-symbolizer
// (which TSan runs to print reports) included, where no TSan runtime defines
// them and no abseil lock is taken.
#pragma weak __tsan_mutex_pre_lock
#pragma weak __tsan_mutex_post_lock
#pragma weak __tsan_mutex_pre_unlock
#pragma weak __tsan_mutex_post_unlock

namespace {

template <typename Fn>
Fn Real(const char* mangled) {
  void* found = dlsym(RTLD_NEXT, mangled);
  if (found == nullptr) {
    std::fprintf(stderr, "tsan_absl_locks: %s not found in abseil: %s\n", mangled, dlerror());
    std::abort();
  }
  return reinterpret_cast<Fn>(found);
}

// One real function: REAL(name, signature) declares a static pointer to it,
// looked up on first use.
#define REAL(var, type, mangled) static const auto var = Real<type>(mangled)

using MutexFn = void (*)(absl::Mutex*);
using MutexTryFn = bool (*)(absl::Mutex*);
using WhenFn = void (*)(absl::Mutex*, const absl::Condition&);
using WhenDeadlineFn = bool (*)(absl::Mutex*, const absl::Condition&, absl::Time);
using WaitFn = void (*)(absl::CondVar*, absl::Mutex*);
using WaitDeadlineFn = bool (*)(absl::CondVar*, absl::Mutex*, absl::Time);

// Acquires `mu` through `acquire` (which returns whether it did).
template <typename Acquire>
bool Acquiring(absl::Mutex* mu, unsigned flags, Acquire acquire) {
  __tsan_mutex_pre_lock(mu, flags);
  const bool acquired = acquire();
  __tsan_mutex_post_lock(mu, acquired ? flags : flags | __tsan_mutex_try_lock_failed, 0);
  return acquired;
}

// Runs `release` (which gives up `mu`) between unlock annotations.
template <typename Release>
void Releasing(absl::Mutex* mu, unsigned flags, Release release) {
  __tsan_mutex_pre_unlock(mu, flags);
  release();
  __tsan_mutex_post_unlock(mu, flags);
}

// Runs `wait`, which may give `mu` up and always holds it again on return:
// seen as an unlock then a lock (as if it always waited).
template <typename Wait>
auto Waiting(absl::Mutex* mu, unsigned flags, Wait wait) {
  __tsan_mutex_pre_unlock(mu, flags);
  auto result = wait();
  __tsan_mutex_post_unlock(mu, flags);
  __tsan_mutex_pre_lock(mu, flags);
  __tsan_mutex_post_lock(mu, flags, 0);
  return result;
}

constexpr unsigned kWrite = 0;
constexpr unsigned kRead = __tsan_mutex_read_lock;

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

void Mutex::Lock() {
  REAL(real, MutexFn, "_ZN4absl7debian35Mutex4LockEv");
  Acquiring(this, kWrite, [&] { return real(this), true; });
}

void Mutex::ReaderLock() {
  REAL(real, MutexFn, "_ZN4absl7debian35Mutex10ReaderLockEv");
  Acquiring(this, kRead, [&] { return real(this), true; });
}

bool Mutex::TryLock() {
  REAL(real, MutexTryFn, "_ZN4absl7debian35Mutex7TryLockEv");
  return Acquiring(this, __tsan_mutex_try_lock, [&] { return real(this); });
}

bool Mutex::ReaderTryLock() {
  REAL(real, MutexTryFn, "_ZN4absl7debian35Mutex13ReaderTryLockEv");
  return Acquiring(this, __tsan_mutex_try_read_lock, [&] { return real(this); });
}

void Mutex::Unlock() {
  REAL(real, MutexFn, "_ZN4absl7debian35Mutex6UnlockEv");
  Releasing(this, kWrite, [&] { real(this); });
}

void Mutex::ReaderUnlock() {
  REAL(real, MutexFn, "_ZN4absl7debian35Mutex12ReaderUnlockEv");
  Releasing(this, kRead, [&] { real(this); });
}

// The When forms always return holding the lock, whatever they answer.
void Mutex::LockWhen(const Condition& cond) {
  REAL(real, WhenFn, "_ZN4absl7debian35Mutex8LockWhenERKNS0_9ConditionE");
  Acquiring(this, kWrite, [&] { return real(this, cond), true; });
}

void Mutex::ReaderLockWhen(const Condition& cond) {
  REAL(real, WhenFn, "_ZN4absl7debian35Mutex14ReaderLockWhenERKNS0_9ConditionE");
  Acquiring(this, kRead, [&] { return real(this, cond), true; });
}

bool Mutex::LockWhenWithDeadline(const Condition& cond, Time deadline) {
  REAL(real, WhenDeadlineFn,
       "_ZN4absl7debian35Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  bool result = false;
  Acquiring(this, kWrite, [&] { return result = real(this, cond, deadline), true; });
  return result;
}

bool Mutex::ReaderLockWhenWithDeadline(const Condition& cond, Time deadline) {
  REAL(real, WhenDeadlineFn,
       "_ZN4absl7debian35Mutex26ReaderLockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  bool result = false;
  Acquiring(this, kRead, [&] { return result = real(this, cond, deadline), true; });
  return result;
}

// Await may give the lock up while it waits (a writer's hold, as absl
// requires of Await's callers in this code).
void Mutex::Await(const Condition& cond) {
  REAL(real, WhenFn, "_ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE");
  Waiting(this, kWrite, [&] { return real(this, cond), true; });
}

bool Mutex::AwaitWithDeadline(const Condition& cond, Time deadline) {
  REAL(real, WhenDeadlineFn,
       "_ZN4absl7debian35Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  return Waiting(this, kWrite, [&] { return real(this, cond, deadline); });
}

void CondVar::Wait(Mutex* mu) {
  REAL(real, WaitFn, "_ZN4absl7debian37CondVar4WaitEPNS0_5MutexE");
  Waiting(mu, kWrite, [&] { return real(this, mu), true; });
}

bool CondVar::WaitWithDeadline(Mutex* mu, Time deadline) {
  REAL(real, WaitDeadlineFn, "_ZN4absl7debian37CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
  return Waiting(mu, kWrite, [&] { return real(this, mu, deadline); });
}

ABSL_NAMESPACE_END
}  // namespace absl
