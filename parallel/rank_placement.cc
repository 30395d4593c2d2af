// Rank placement table (parallel/rank_placement.h).
#include "parallel/rank_placement.h"

#include <sched.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "core/tensor.h"

namespace smat {
namespace {

// One rank's row as a fixed-size record, so a single AllGather moves all of
// them: host name, physical GPU id (both NUL-padded), the CPU affinity mask
// (bit c: CPU c), then three int32.
constexpr int kMaskCpus = 1024;
struct PlacementRecord {
  char host[64];
  char physical_gpu[16];
  uint64_t cpus[kMaskCpus / 64];
  int32_t local_rank;
  int32_t gpu;
  int32_t launch_ok;  // 1: the launch environment matched MPI
  int32_t padding;
};

// This process's CPU affinity as a bit mask; all zeros when it cannot be read.
void ReadCpuMask(uint64_t (&mask)[kMaskCpus / 64]) {
  std::memset(mask, 0, sizeof(mask));
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return;
  for (int c = 0; c < kMaskCpus && c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) mask[c / 64] |= uint64_t{1} << (c % 64);
  }
}

std::vector<int> CpusOf(const uint64_t (&mask)[kMaskCpus / 64]) {
  std::vector<int> cpus;
  for (int c = 0; c < kMaskCpus; ++c) {
    if ((mask[c / 64] >> (c % 64)) & 1) cpus.push_back(c);
  }
  return cpus;
}
static_assert(sizeof(PlacementRecord) % 8 == 0, "records travel as int64 words");
constexpr int64_t kRecordWords = sizeof(PlacementRecord) / 8;

}  // namespace

absl::StatusOr<PlacementReport> DescribeRankPlacement(MpiCommunicator& control,
                                                      const ProcessGroup& pg,
                                                      const EnvironmentLookup& lookup) {
  absl::StatusOr<LaunchEnvironment> env = ReadLaunchEnvironment(lookup);
  absl::Status mine = env.status();
  if (mine.ok()) mine = CheckAgainstMpi(*env, control.rank(), control.size());

  PlacementRecord rec;
  std::memset(&rec, 0, sizeof(rec));
  ::gethostname(rec.host, sizeof(rec.host) - 1);
  const std::string visible = env.ok() ? env->visible_devices : "";
  if (pg.device() >= 0) {
    const std::string physical = PhysicalGpu(pg.device(), visible);
    std::strncpy(rec.physical_gpu, physical.c_str(), sizeof(rec.physical_gpu) - 1);
  }
  ReadCpuMask(rec.cpus);
  rec.local_rank = pg.local_rank();
  rec.gpu = pg.device();
  rec.launch_ok = mine.ok() ? 1 : 0;

  SMAT_ASSIGN_OR_RETURN(Tensor send, Tensor::Zeros({kRecordWords}, DType::kI64));
  std::memcpy(send.raw(), &rec, sizeof(rec));
  SMAT_ASSIGN_OR_RETURN(Tensor recv, Tensor::Zeros({control.size() * kRecordWords}, DType::kI64));
  SMAT_RETURN_IF_ERROR(control.AllGather(send, recv));
  if (!mine.ok()) return mine;

  PlacementReport report;
  report.allowed_cpus = static_cast<int>(CpusOf(rec.cpus).size());
  report.ranks_sharing_cpus = 0;
  std::vector<RankPlacement> rows;
  const auto* all = static_cast<const PlacementRecord*>(recv.raw());
  for (int r = 0; r < control.size(); ++r) {
    const PlacementRecord& p = all[r];
    if (p.launch_ok != 1) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rank ", r, " on ", std::string(p.host, strnlen(p.host, sizeof(p.host))),
          " has an inconsistent launch environment; see its message"));
    }
    RankPlacement row;
    row.rank = r;
    row.host.assign(p.host, strnlen(p.host, sizeof(p.host)));
    row.local_rank = p.local_rank;
    row.gpu = p.gpu;
    row.physical_gpu.assign(p.physical_gpu, strnlen(p.physical_gpu, sizeof(p.physical_gpu)));
    row.cpus = FormatCpuList(CpusOf(p.cpus));
    if (std::strncmp(p.host, rec.host, sizeof(rec.host)) == 0 &&
        std::memcmp(p.cpus, rec.cpus, sizeof(rec.cpus)) == 0) {
      ++report.ranks_sharing_cpus;  // this rank's own row included
    }
    rows.push_back(row);
  }
  report.table = FormatPlacementTable(rows, env->launcher);
  // MPI's split decides the GPU; a launcher that counts local ranks
  // differently (ranks of one host in two MPI jobs) is worth a line.
  if (env->local_rank >= 0 && env->local_rank != pg.local_rank()) {
    absl::StrAppend(&report.table, "\nsmat: note: rank ", control.rank(), ": ", env->launcher,
                    " local rank ", env->local_rank, " differs from MPI's ", pg.local_rank(),
                    "; the GPU follows MPI's");
  }
  return report;
}

}  // namespace smat
