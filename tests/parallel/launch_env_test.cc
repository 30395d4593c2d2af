// parallel/launch_env.h against fake environments: which launcher's
// variables win, bad values, the srun-without-PMI mismatch, GPU choice and
// the placement table.
#include "parallel/launch_env.h"

#include <map>
#include <string>

#include "gtest/gtest.h"

namespace smat {
namespace {

// A fake environment: only the variables listed are set.
EnvironmentLookup Env(std::map<std::string, std::string> vars) {
  auto owned = std::make_shared<std::map<std::string, std::string>>(std::move(vars));
  return [owned](const char* name) -> const char* {
    auto it = owned->find(name);
    return it == owned->end() ? nullptr : it->second.c_str();
  };
}

TEST(LaunchEnvTest, NothingSetFallsBackToMpi) {
  absl::StatusOr<LaunchEnvironment> env = ReadLaunchEnvironment(Env({}));
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_FALSE(env->found());
  EXPECT_EQ(env->rank, -1);
  EXPECT_EQ(env->local_rank, -1);
  EXPECT_TRUE(CheckAgainstMpi(*env, 3, 8).ok());
}

TEST(LaunchEnvTest, OpenMpi) {
  absl::StatusOr<LaunchEnvironment> env = ReadLaunchEnvironment(
      Env({{"OMPI_COMM_WORLD_RANK", "5"}, {"OMPI_COMM_WORLD_SIZE", "8"},
           {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}}));
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->launcher, "Open MPI");
  EXPECT_EQ(env->rank, 5);
  EXPECT_EQ(env->size, 8);
  EXPECT_EQ(env->local_rank, 1);
  EXPECT_EQ(env->local_size, 4);
  EXPECT_TRUE(CheckAgainstMpi(*env, 5, 8).ok());
}

TEST(LaunchEnvTest, SlurmWithNodeName) {
  absl::StatusOr<LaunchEnvironment> env = ReadLaunchEnvironment(
      Env({{"SLURM_PROCID", "6"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "2"},
           {"SLURMD_NODENAME", "gpu-b"}}));
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->launcher, "Slurm");
  EXPECT_EQ(env->rank, 6);
  EXPECT_EQ(env->size, 8);
  EXPECT_EQ(env->local_rank, 2);
  EXPECT_EQ(env->local_size, -1);  // Slurm has no plain variable for it
  EXPECT_EQ(env->node, "gpu-b");
}

// mpirun inside a Slurm allocation: both sets exist; the batch step's
// SLURM_PROCID = 0 / SLURM_NTASKS = 1 must not be taken for the rank.
TEST(LaunchEnvTest, OpenMpiWinsOverSlurm) {
  absl::StatusOr<LaunchEnvironment> env = ReadLaunchEnvironment(
      Env({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"SLURM_LOCALID", "0"},
           {"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"},
           {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}}));
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->launcher, "Open MPI");
  EXPECT_EQ(env->rank, 3);
  EXPECT_EQ(env->size, 4);
  EXPECT_EQ(env->local_rank, 1);
  EXPECT_TRUE(CheckAgainstMpi(*env, 3, 4).ok());
}

TEST(LaunchEnvTest, Hydra) {
  absl::StatusOr<LaunchEnvironment> env = ReadLaunchEnvironment(
      Env({{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}, {"MPI_LOCALRANKID", "1"},
           {"MPI_LOCALNRANKS", "2"}}));
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->launcher, "MPICH/PMI");
  EXPECT_EQ(env->local_rank, 1);
  EXPECT_EQ(env->local_size, 2);
}

TEST(LaunchEnvTest, BadValuesNameTheVariable) {
  absl::StatusOr<LaunchEnvironment> env =
      ReadLaunchEnvironment(Env({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "eight"}}));
  ASSERT_FALSE(env.ok());
  EXPECT_EQ(env.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(env.status().message().find("SLURM_NTASKS='eight'"), std::string::npos)
      << env.status();

  env = ReadLaunchEnvironment(Env({{"OMPI_COMM_WORLD_RANK", "4"}, {"OMPI_COMM_WORLD_SIZE", "4"}}));
  ASSERT_FALSE(env.ok());
  EXPECT_NE(env.status().message().find("not below OMPI_COMM_WORLD_SIZE=4"), std::string::npos)
      << env.status();

  env = ReadLaunchEnvironment(Env({{"OMPI_COMM_WORLD_RANK", "-1"}}));
  EXPECT_FALSE(env.ok());
}

// srun without --mpi=pmix: 8 tasks, each a one-rank MPI world.
TEST(LaunchEnvTest, SrunWithoutPmixIsCaught) {
  absl::StatusOr<LaunchEnvironment> env = ReadLaunchEnvironment(
      Env({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "3"}}));
  ASSERT_TRUE(env.ok()) << env.status();
  absl::Status s = CheckAgainstMpi(*env, 0, 1);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("--mpi=pmix"), std::string::npos) << s;
  EXPECT_NE(s.message().find("started 8 task(s)"), std::string::npos) << s;

  // Same size, different rank: stale variables from another launch.
  s = CheckAgainstMpi(*env, 2, 8);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("rank 3"), std::string::npos) << s;
}

TEST(LaunchEnvTest, GpuFollowsLocalRankUnlessOneIsVisible) {
  EXPECT_EQ(GpuForLocalRank(3, ""), 3);
  EXPECT_EQ(GpuForLocalRank(3, "0,1,2,3"), 3);
  EXPECT_EQ(GpuForLocalRank(3, "5"), 0);  // Slurm --gpus-per-task=1: its own GPU
  EXPECT_EQ(GpuForLocalRank(-1, ""), 0);
  EXPECT_EQ(PhysicalGpu(1, "2,3"), "3");
  EXPECT_EQ(PhysicalGpu(0, "7"), "7");
  EXPECT_EQ(PhysicalGpu(2, ""), "2");
}

TEST(LaunchEnvTest, PlacementTable) {
  std::vector<RankPlacement> rows = {
      {0, "node-a", 0, 0, "0", "0-15"},
      {1, "node-a", 1, 1, "3", "16-31"},
      {2, "b", 0, -1, "", "0,2"},
  };
  EXPECT_EQ(FormatPlacementTable(rows, "Open MPI"),
            "smat: 3 ranks launched by Open MPI on 2 hosts\n"
            "  rank  host    local  cpus   gpu\n"
            "     0  node-a      0  0-15   cuda:0\n"
            "     1  node-a      1  16-31  cuda:1 (physical 3)\n"
            "     2  b           0  0,2    cpu");
  EXPECT_EQ(FormatPlacementTable({{0, "h", 0, -1, "", "0"}}, ""),
            "smat: 1 rank launched by MPI (local ranks from MPI_Comm_split_type) on 1 host\n"
            "  rank  host  local  cpus  gpu\n"
            "     0  h         0  0     cpu");
}

TEST(LaunchEnvTest, CpuListsAsRanges) {
  EXPECT_EQ(FormatCpuList({0, 1, 2, 3, 8, 10, 11}), "0-3,8,10-11");
  EXPECT_EQ(FormatCpuList({5}), "5");
  EXPECT_EQ(FormatCpuList({0, 2, 4}), "0,2,4");
  EXPECT_EQ(FormatCpuList({0, 1}), "0-1");
  EXPECT_EQ(FormatCpuList({}), "-");
}

TEST(LaunchEnvTest, CpuThreadsShareTheRanksCpus) {
  // Two unbound ranks on a 2-CPU host: one thread each.
  EXPECT_EQ(CpuThreadsPerRank(Env({}), /*ranks_sharing_cpus=*/2, /*allowed_cpus=*/2), 1);
  // Four on 16 CPUs: four each; three on 16: five each (rounded down).
  EXPECT_EQ(CpuThreadsPerRank(Env({}), 4, 16), 4);
  EXPECT_EQ(CpuThreadsPerRank(Env({}), 3, 16), 5);
  // Two ranks bound to the same 8-CPU socket: four each.
  EXPECT_EQ(CpuThreadsPerRank(Env({}), 2, 8), 4);
  // More ranks than CPUs: still one thread.
  EXPECT_EQ(CpuThreadsPerRank(Env({}), 8, 2), 1);
}

TEST(LaunchEnvTest, CpuThreadsLeftAloneWhereTheyNeedNoShare) {
  // No other rank on these CPUs (one rank, or bound to CPUs of its own):
  // OpenBLAS's own choice, which counts the CPUs the rank may use.
  EXPECT_EQ(CpuThreadsPerRank(Env({}), 1, 16), 0);
  EXPECT_EQ(CpuThreadsPerRank(Env({}), 0, 16), 0);
  // The affinity could not be read.
  EXPECT_EQ(CpuThreadsPerRank(Env({}), 4, 0), 0);
  // The user chose: any of OpenBLAS's variables, whatever its value.
  EXPECT_EQ(CpuThreadsPerRank(Env({{"OPENBLAS_NUM_THREADS", "2"}}), 2, 2), 0);
  EXPECT_EQ(CpuThreadsPerRank(Env({{"GOTO_NUM_THREADS", "2"}}), 2, 2), 0);
  EXPECT_EQ(CpuThreadsPerRank(Env({{"OMP_NUM_THREADS", "8"}}), 4, 16), 0);
}

}  // namespace
}  // namespace smat
